"""DistributedLion on FSDP2 with context parallelism, on 4 real CPU ranks
as dp 2 x cp 2: the cp ranks of a dp index split its sequences, FSDP
shards over all 4 (torchtitan's fsdp dim, dp_shard x cp), and the user
tells attach which ranks split a sequence
(``opt.attach(model, context_parallel=mesh["cp"])``). Written as the
training script a user writes: each cp rank embeds its chunk of the
tokens, attention gathers the keys and values of the whole sequence from
the cp ranks (the all-gather form of context parallelism, causal over
global positions), and the loss is the rank's chunk's. Also under HSDP
(2 nodes of cp 2), on spmd_types storage meshes, beside tensor
parallelism (dp 2 x cp 2 x tp 2 on 8 ranks) and beside an MoE's expert
parallelism (ep spanning the cp ranks: an expert's gradient gathers the
worker's tokens, its worker the efsdp rank, /cp where FSDP averages).

The reference runs in the same ranks with no lionbit or FSDP code: the
same model alone (each rank's gradient by the same kernels and the same
cp collectives), the worker's gradient as its cp ranks' mean, (a + b) / 2
in float32 (their sum under torchtitan's divide factor 1.0, the loss
normalized by the global token count), and Distributed Lion with 2
workers in plain torch (test_fsdp_tp.lion_step). Every step's parameters
and every rank's momentum are compared with it, bitwise; the same script
without ``context_parallel`` (each rank a worker) is not it. On a GPU the
same runs on CUDA parameters (4 ranks on one GPU, Gloo underneath)."""

from itertools import compress

import pytest
import torch

import test_fsdp_ep as ep
import test_fsdp_tp as tp
from harness import run_ranks, values

DP, CP, TP = 2, 2, 2
V, H, B, T = 30, 26, 2, 8  # vocabulary, MLP width, sequences a worker, tokens (T / CP a rank)
D = ep.D  # the width (test_fsdp_ep's MoE's)
LION = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
SCALE = 1024.0  # GradScaler's initial scale
MAX_NORM = 0.5


class GatherSequence(torch.autograd.Function):
    """Every cp rank's chunk of x along dim 1, in order (the keys and
    values of the whole sequence); backward: the sum of the ranks'
    gradients of this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        torch.distributed.all_reduce(g, group=ctx.group)
        return g.chunk(ctx.group.size(), dim=1)[ctx.group.rank()], None


def _attention(q, k, v, mask):
    """torch's attention; on a GPU its math form, whose backward is deterministic (the fused kernels' need not
    be: the reference and the FSDP run compute each gradient apart)."""
    if not q.is_cuda:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Block(torch.nn.Module):
    """Attention over the whole sequence, then an MLP (``moe``: test_fsdp_ep's MoE)."""

    def __init__(self, cp_group, moe=False):
        super().__init__()
        self.cp = cp_group
        self.norm = torch.nn.LayerNorm(D)
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(D, D) for _ in range(4))
        self.mlp_norm = torch.nn.LayerNorm(D)
        if moe:
            self.moe = ep.MoE()
        else:
            self.w1, self.w2 = torch.nn.Linear(D, H), torch.nn.Linear(H, D)

    def forward(self, x):
        h = self.norm(x)
        q = self.wq(h)
        k, v = GatherSequence.apply(self.wk(h), self.cp), GatherSequence.apply(self.wv(h), self.cp)
        t = x.shape[1]
        rows = torch.arange(t, device=x.device) + self.cp.rank() * t  # this chunk's global positions
        mask = torch.arange(k.shape[1], device=x.device)[None, :] <= rows[:, None]
        x = x + self.wo(_attention(q, k, v, mask))
        h = self.mlp_norm(x)
        return x + (self.moe(h) if hasattr(self, "moe") else self.w2(torch.nn.functional.gelu(self.w1(h))))


class LM(torch.nn.Module):
    def __init__(self, cp_group, moe=False):
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.layers = torch.nn.ModuleList([Block(cp_group, moe) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _config(**kw):
    cfg = dict(hsdp=False, aggregation="vote", steps=4, accumulate=1, scaler=False, clip=False, inf=None,
               titan=False, tell=True, tp=False, spmd=False, ep=False, sync=None)
    cfg.update(kw)
    return cfg


# -- the ranks: the user's training script ------------------------------------------------------------------


def _meshes(hsdp, spmd=False, device="cpu"):
    """torchtitan's meshes over the same ranks: FSDP's (fsdp = dp_shard x cp, one dim; HSDP: 2 nodes,
    dp_replicate x fsdp, a node's fsdp being its cp ranks) and the data's (dp, cp); ``spmd``: its storage mesh
    (dp_shard, cp), or (dp_replicate, dp_shard 1, cp), for its default spmd_types backend."""
    from torch.distributed.device_mesh import init_device_mesh

    data = init_device_mesh(device, (DP, CP), mesh_dim_names=("dp", "cp"))
    if spmd:
        shape, names = ((DP, 1, CP), ("dp_replicate", "dp_shard", "cp")) if hsdp else ((DP, CP), ("dp_shard", "cp"))
        return init_device_mesh(device, shape, mesh_dim_names=names), data
    if hsdp:
        return init_device_mesh(device, (DP, CP), mesh_dim_names=("dp_replicate", "fsdp")), data
    return init_device_mesh(device, (DP * CP,), mesh_dim_names=("fsdp",)), data


def _ep_mesh(device="cpu"):
    """torchtitan's sparse mesh for the experts, (efsdp, ep): ep spans the cp ranks (ep = cp here)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device, (DP, CP), mesh_dim_names=("efsdp", "ep"))


def _tp_meshes(device="cpu"):
    """The same beside tensor parallelism: FSDP's (fsdp, tp) and the data's (dp, cp, tp)."""
    from torch.distributed.device_mesh import init_device_mesh

    data = init_device_mesh(device, (DP, CP, TP), mesh_dim_names=("dp", "cp", "tp"))
    return init_device_mesh(device, (DP * CP, TP), mesh_dim_names=("fsdp", "tp")), data


def _batch(data, step, micro):
    """This rank's chunk of its dp index's sequences, and their targets."""
    gen = torch.Generator().manual_seed(1000 * data["dp"].get_local_rank() + 10 * step + micro)
    tokens, targets = torch.randint(V, (B, T), generator=gen), torch.randint(V, (B, T), generator=gen)
    c, n, device = data["cp"].get_local_rank(), T // CP, data.device_type
    return tokens[:, c * n:(c + 1) * n].to(device), targets[:, c * n:(c + 1) * n].to(device)


def _loss(model, data, cfg, step, micro):
    tokens, targets = _batch(data, step, micro)
    logits = model(tokens)
    if cfg["inf"] == [step, torch.distributed.get_rank()] and micro == 0:
        logits.register_hook(lambda g: g.index_put(tuple(torch.tensor([i], device=g.device) for i in (0, 1, 2)),
                                                   torch.tensor([float("inf")], device=g.device)))
    flat, want = logits.reshape(-1, V), targets.reshape(-1)
    if cfg["titan"]:  # torchtitan: the loss normalized by the global token count, FSDP's division off
        return torch.nn.functional.cross_entropy(flat, want, reduction="sum") / (DP * B * T * cfg["accumulate"])
    return torch.nn.functional.cross_entropy(flat, want) / cfg["accumulate"]


def _model(data, dense=None, sparse=None):
    """The LM; with ``dense`` (the (fsdp, tp) mesh), each block's linears split over tp (torch's
    ColwiseParallel and RowwiseParallel; the attention's features split, its sequence still the cp ranks');
    with ``sparse`` (the (efsdp, ep) mesh), each block's MLP an MoE whose experts are split over ep."""
    torch.manual_seed(0)
    model = LM(data["cp"].get_group(), moe=sparse is not None).to(data.device_type)
    if sparse is not None:
        for layer in model.layers:
            ep.expert_parallel(layer.moe.experts, sparse["ep"])
    if dense is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for layer in model.layers:
            parallelize_module(layer, dense["tp"], {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                                    "wv": ColwiseParallel(), "wo": RowwiseParallel(),
                                                    "w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return model


def _fsdp_model(fsdp_mesh, data, cfg, sparse=None):
    from torch.distributed.fsdp import fully_shard

    model = _model(data, fsdp_mesh if cfg["tp"] else None, sparse)
    kw = dict(mesh=fsdp_mesh["fsdp"] if cfg["tp"] else fsdp_mesh)
    if cfg["spmd"]:  # every parameter annotated replicated over the storage mesh, FSDP told its dims
        import spmd_types as spmd
        from torch.distributed.fsdp import DataParallelMeshDims  # (torch >= 2.12)

        with spmd.set_current_mesh(fsdp_mesh):
            for p in model.parameters():
                spmd.assert_type(p, {name: spmd.R for name in fsdp_mesh.mesh_dim_names})
        kw["dp_mesh_dims"] = DataParallelMeshDims(shard=("dp_shard", "cp"),
                                                  replicate="dp_replicate" if cfg["hsdp"] else None)
    for layer in model.layers:
        if sparse is not None:  # torchtitan's: the experts over efsdp, then the block over fsdp
            fully_shard(layer.moe.experts, mesh=sparse["efsdp"])
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if cfg["titan"]:
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
    return model


def _train(cfg, model, data, fsdp_mesh):
    import contextlib

    import lionbit

    if cfg["spmd"]:
        import spmd_types as spmd

        region = lambda: spmd.set_current_mesh(fsdp_mesh)  # noqa: E731 - torchtitan runs the model in its mesh
    else:
        region = contextlib.nullcontext
    opt = lionbit.DistributedLion(model.parameters(), aggregation=cfg["aggregation"], momentum_sync=cfg["sync"], **LION)
    opt.attach(model, context_parallel=data["cp"] if cfg["tell"] else None)
    lionbit.reset_stats(opt.attachment.dp.vote_group)  # (the vote's group: the one attach made, or FSDP's)
    scaler = torch.amp.GradScaler(data.device_type, init_scale=SCALE) if cfg["scaler"] else None
    params = list(model.parameters())
    traj, norms = [], []
    for step in range(cfg["steps"]):
        for micro in range(cfg["accumulate"]):
            model.set_requires_gradient_sync(micro == cfg["accumulate"] - 1)
            with region():
                loss = _loss(model, data, cfg, step, micro)
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if cfg["clip"]:
            norms.append(_clip(params))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        traj.append([tp._full(p) for p in params])
    return {
        "traj": traj,
        "norms": norms,
        "steps": opt.steps_taken,
        "momentum": [_full_momentum(p, opt.state[p]["exp_avg"]) for p in params],
        "vote_group": opt.attachment.dp.vote_group,
        "replayed": opt.attachment.plan.replayed,  # steps voted as planned (lionbit.fsdp_plan)
    }


def _clip(params) -> str:
    """clip_grad_norm_; with experts torchtitan's (their norm and the rest's apart: their meshes differ)."""
    if any(map(ep._is_expert, params)):
        return repr(float(ep._clip_with_ep(params, MAX_NORM)))
    return repr(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))


def _full_momentum(p, m):
    """The worker's momentum of p (its tensor-parallel part): a rank's own on a 1-D mesh; under HSDP its
    node's, gathered."""
    from torch.distributed.tensor import DTensor, Replicate

    if p.placements[0] != Replicate():
        return m.flatten().tolist()

    return DTensor.from_local(m, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor() \
        .flatten().tolist()


# -- the reference: the same model alone, Distributed Lion in plain torch ---------------------------------------


def _reference(cfg, data, model, sparse=None):
    """Each worker's gradient of a parameter is its cp ranks' mean (an expert's: its ep group's gradient,
    which gathered the cp ranks' tokens, /CP), voted over the dp ranks (an expert's over efsdp)."""
    dist = torch.distributed
    params = list(model.parameters())
    cp, dp = data["cp"].get_group(), data["dp"].get_group()
    experts = [ep._is_expert(p) for p in params]
    groups = [sparse["efsdp"].get_group() if e else dp for e in experts]
    momentum = [[torch.zeros_like(tp._local(p)) for _ in range(DP)] for p in params]
    report = {"traj": [], "applied": 0, "norms": []}
    for step in range(cfg["steps"]):
        model.zero_grad(set_to_none=True)
        for micro in range(cfg["accumulate"]):
            loss = _loss(model, data, cfg, step, micro)
            (loss * SCALE if cfg["scaler"] else loss).backward()
        for p, expert in zip(params, experts):  # the worker's: (a + b) / 2 over its cp ranks; torchtitan's a + b
            g = tp._local(p.grad)  # (its tensor-parallel part)
            if not expert:
                dist.all_reduce(g, group=cp)
            if not cfg["titan"]:
                g.div_(CP)
            if cfg["scaler"]:
                g.div_(SCALE)
        if cfg["clip"]:
            report["norms"].append(_clip(params))
        finite = torch.tensor([all(bool(torch.isfinite(tp._local(p.grad)).all()) for p in params)],
                              dtype=torch.int32)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            report["traj"].append("skipped")
            continue
        for i, p in enumerate(params):
            with torch.no_grad():
                tp.lion_step(tp._local(p), tp._gather(tp._local(p.grad), groups[i]), momentum[i], cfg["aggregation"])
        report["applied"] += 1
        report["traj"].append([tp._full(p) for p in params])
    report["momentum"] = [momentum[i][dist.get_rank(groups[i])].flatten().tolist() for i in range(len(params))]
    n = DP * CP  # FSDP pads each (tensor-parallel-local) dense parameter's dim 0 to a multiple of its ranks
    report["elements"] = sum(-(-tp._local(p).shape[0] // n) * n * tp._local(p)[0].numel()
                             for p, expert in zip(params, experts) if not expert)
    report["experts"] = experts
    return report


def fsdp_cp_runs(rank, world_size, configs, device="cpu"):
    """Each config's run and reference on this rank; ``device="cuda"``: every rank on the host's GPU of its
    rank (several on one), torch's deterministic algorithms on while the runs last."""
    if device != "cuda":
        return _fsdp_cp_runs(configs, device)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _fsdp_cp_runs(configs, device)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _fsdp_cp_runs(configs, device):
    import lionbit

    out = []
    for cfg in configs:
        fsdp_mesh, data = _tp_meshes(device) if cfg["tp"] else _meshes(cfg["hsdp"], cfg["spmd"], device)
        sparse = _ep_mesh(device) if cfg["ep"] else None
        model = _fsdp_model(fsdp_mesh, data, cfg, sparse)
        shard_group = next(model.parameters()).device_mesh.get_group(1 if cfg["hsdp"] else 0)  # FSDP's shard group
        lionbit.reset_stats(shard_group)
        run = _train(cfg, model, data, fsdp_mesh)
        group = run.pop("vote_group")
        run["stats"] = lionbit.stats(group)
        run["fsdp_stats"] = lionbit.stats(shard_group)
        run["vote_ranks"] = torch.distributed.get_process_group_ranks(group)
        run["ref"] = tp.single_threaded(_reference, cfg, data, _model(data, fsdp_mesh if cfg["tp"] else None, sparse),
                                        sparse)
        run["devices"] = sorted({str(p.device) for p in model.parameters()})
        out.append(run)
    return out


# -- the tests ------------------------------------------------------------------------------------------------

CONFIGS = {
    "dp 2 x cp 2: vote": _config(),
    "dp 2 x cp 2: avg, 2 micro-batches, GradScaler, clipping, an inf in rank 2's backward": _config(
        aggregation="avg", accumulate=2, scaler=True, clip=True, inf=[1, 2]),
    "dp 2 x cp 2, torchtitan's loss and divide factor 1.0: vote, clipping": _config(titan=True, clip=True),
    # (no clipping: under HSDP the norm is FSDP's over the node's shards, a sum in another order than this
    # reference's; test_hsdp checks it against its own)
    "HSDP, 2 nodes of cp 2: avg, GradScaler, an inf in rank 3's backward": _config(
        hsdp=True, aggregation="avg", scaler=True, inf=[2, 3]),
    "dp 2 x cp 2 without context_parallel": _config(tell=False, steps=2),
    "dp 2 x cp 2, Lion Cub's momentum sync every 2 steps": _config(sync=2),
    "dp 2 x cp 2, an MoE with ep 2 (= cp, efsdp 2): avg, clipping": _config(ep=True, aggregation="avg", clip=True),
    "dp 2 x cp 2, an MoE with ep 2, torchtitan's loss and divide factor 1.0: vote": _config(ep=True, titan=True),
}
try:  # torchtitan's default backend: FSDP over the storage mesh's dims ("dp_shard", "cp")
    import spmd_types  # noqa: F401
    from torch.distributed.fsdp import DataParallelMeshDims  # noqa: F401 - (torch >= 2.12)

    CONFIGS |= {
        "spmd_types, storage mesh (dp_shard 2, cp 2): avg, clipping": _config(spmd=True, aggregation="avg",
                                                                               clip=True),
        "spmd_types, HSDP storage mesh (dp_replicate 2, dp_shard 1, cp 2): vote": _config(spmd=True, hsdp=True),
    }
except ImportError:  # (tools/requirements-dev.txt installs it; torch 2.11's FSDP has no storage meshes)
    pass


@pytest.fixture(scope="module")
def runs():
    per_rank = values(run_ranks("test_fsdp_cp:fsdp_cp_runs", DP * CP, kwargs=dict(configs=list(CONFIGS.values())),
                                timeout=300))
    return {name: [r[i] for r in per_rank] for i, name in enumerate(CONFIGS)}


TP_CONFIGS = {
    "dp 2 x cp 2 x tp 2: vote, 2 micro-batches, GradScaler, an inf in rank 5's backward": _config(
        tp=True, accumulate=2, scaler=True, inf=[1, 5], steps=3),
}


@pytest.fixture(scope="module")
def tp_runs():
    per_rank = values(run_ranks("test_fsdp_cp:fsdp_cp_runs", DP * CP * TP,
                                kwargs=dict(configs=list(TP_CONFIGS.values())), timeout=300))
    return {name: [r[i] for r in per_rank] for i, name in enumerate(TP_CONFIGS)}


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c["tell"] and not c["sync"]] + list(TP_CONFIGS))
def test_fsdp_cp_equals_the_reference_bitwise(request, name):
    cfg = CONFIGS.get(name) or TP_CONFIGS[name]
    _check_bitwise(name, cfg, request.getfixturevalue("tp_runs" if cfg["tp"] else "runs")[name])


def _check_bitwise(name, cfg, per_rank) -> None:
    ranks = len(per_rank)
    for rank, run in enumerate(per_rank):
        ref = run["ref"]
        assert run["traj"] == per_rank[0]["traj"], rank  # every rank holds the same parameters
        tp.check_trajectory(name, rank, run, ref)
        assert run["momentum"] == ref["momentum"], (name, rank)  # its worker's, whole
        assert run["norms"] == ref["norms"], (name, rank)  # clipping saw the worker's gradient
        assert run["steps"] == ref["applied"] == cfg["steps"] - (cfg["inf"] is not None)
        if cfg["aggregation"] == "vote" and not cfg["accumulate"] > 1:  # the planned step replays the first
            assert run["replayed"] == cfg["steps"] - 1, run["replayed"]
        st, fsdp_st = run["stats"], run["fsdp_stats"]
        if cfg["hsdp"]:  # the nodes vote over the replicate group, a rank its shard of its node's
            assert run["steps"] <= st["sign_allreduce_calls"] <= cfg["steps"], st
            continue
        # the dp ranks of this rank's cp index vote its share: FSDP's chunks of those ranks, 1/CP of the model
        worker = ranks // DP  # ranks a worker
        assert run["vote_ranks"] == [r for r in range(ranks) if r % worker == rank % worker], run["vote_ranks"]
        assert run["steps"] <= st["sign_reduce_scatter_calls"] <= cfg["steps"], st
        per_step = st["elements"] / st["sign_reduce_scatter_calls"]
        assert per_step == ref["elements"] / CP, (per_step, ref["elements"])
        assert not fsdp_st["sign_reduce_scatter_calls"] and not fsdp_st["sign_allreduce_calls"], fsdp_st
    cp_peer, other_worker = ranks // DP // CP, ranks // DP
    dense = [not e for e in per_rank[0]["ref"]["experts"]]
    assert list(compress(per_rank[0]["momentum"], dense)) == list(compress(per_rank[cp_peer]["momentum"], dense))
    assert per_rank[0]["momentum"] != per_rank[other_worker]["momentum"]  # the workers' differ
    assert per_rank[0]["traj"][0] != per_rank[0]["traj"][-1]  # the parameters moved


GPU_CONFIGS = [
    "dp 2 x cp 2: vote",
    "dp 2 x cp 2: avg, 2 micro-batches, GradScaler, clipping, an inf in rank 2's backward",
    "HSDP, 2 nodes of cp 2: avg, GradScaler, an inf in rank 3's backward",
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fsdp_cp_on_a_gpu_equals_the_reference_bitwise():
    """The same on CUDA parameters: 4 ranks on the host's GPU (several on one: Gloo carries the CUDA tensors,
    as NCCL refuses), FSDP2's own gradients and the reference's by the same GPU kernels (cuBLAS and torch
    deterministic); the cp all-reduce, the vote group made at attach and the cp ranks' agreement on CUDA."""
    env = {"LIONBIT_CUDA_TRANSPORT": "gloo", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    per_rank = values(run_ranks("test_fsdp_cp:fsdp_cp_runs", DP * CP, env=env, timeout=600,
                                kwargs=dict(configs=[CONFIGS[n] for n in GPU_CONFIGS], device="cuda")))
    for i, name in enumerate(GPU_CONFIGS):
        runs = [r[i] for r in per_rank]
        assert all(run["devices"] == [f"cuda:{rank % torch.cuda.device_count()}"] for rank, run in enumerate(runs))
        _check_bitwise(name, CONFIGS[name], runs)


def test_momentum_sync_averages_the_workers_and_keeps_cp_ranks_alike(runs):
    """Lion Cub's momentum sync averages over the workers (each cp index's dp ranks, whose averages agree): after
    the sync at the last step every rank holds one momentum; before it the workers' differed."""
    per_rank = runs["dp 2 x cp 2, Lion Cub's momentum sync every 2 steps"]
    assert all(r["momentum"] == per_rank[0]["momentum"] for r in per_rank)
    assert all(r["traj"] == per_rank[0]["traj"] for r in per_rank)
    assert per_rank[0]["momentum"] != runs["dp 2 x cp 2: vote"][0]["momentum"]  # (the same run without the sync)


def test_without_context_parallel_each_rank_votes_as_a_worker(runs):
    """The same script without the argument is another optimizer (4 workers, each with a part of a sequence):
    what the reference tells apart."""
    per_rank = runs["dp 2 x cp 2 without context_parallel"]
    for run in per_rank:
        assert run["traj"][-1] != run["ref"]["traj"][-1]
    assert per_rank[0]["momentum"] != per_rank[1]["momentum"]


# -- bad input ------------------------------------------------------------------------------------------------


def _attach_error(build) -> tuple:
    """(the exception's type, its message) that ``build()`` raised, or None."""
    try:
        build()
    except Exception as err:  # noqa: BLE001 - the test names what it expects
        return type(err).__name__, str(err)
    return None


def fsdp_cp_errors(rank, world_size):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    fsdp_mesh, data = _meshes(False)
    hsdp_mesh, _ = _meshes(True)

    def attach(model, cp, **kw):
        return lionbit.DistributedLion(model.parameters(), **kw).attach(model, context_parallel=cp)

    def sharded(mesh, factor=None):
        model = _model(data)
        fully_shard(model, mesh=mesh)
        if factor is not None:
            model.set_gradient_divide_factor(factor)
        return model

    out = {
        "ddp": _attach_error(lambda: attach(DDP(_model(data)), data["cp"])),
        "plain module": _attach_error(lambda: attach(_model(data), data["cp"])),
        "2-D mesh": _attach_error(lambda: attach(sharded(fsdp_mesh), data)),
        "not a mesh": _attach_error(lambda: attach(sharded(fsdp_mesh), 2)),
        "FSDP over dp alone": _attach_error(lambda: attach(sharded(data["dp"]), data["cp"])),
        "HSDP, cp across the nodes": _attach_error(lambda: attach(sharded(hsdp_mesh), data["dp"])),
        "l1": _attach_error(lambda: attach(sharded(fsdp_mesh), data["cp"], aggregation="l1")),
        "divide factor 3": _attach_error(lambda: attach(sharded(fsdp_mesh, 3.0), data["cp"])),
        # torch's own way to fold cp into FSDP's mesh: the flattened mesh knows its "cp" dim
        "flattened (dp, cp), not told": _attach_error(lambda: attach(sharded(data["dp", "cp"]._flatten("dp_cp")),
                                                                      None)),
    }

    def factor_after_attach():  # the factor changed after attach: the first backward says so, on every rank
        model = sharded(fsdp_mesh)
        _opt = attach(model, data["cp"])  # (held: a dropped optimizer detaches)
        model.set_gradient_divide_factor(3.0)
        _loss(model, data, _config(), 0, 0).backward()

    out["divide factor 3 after attach"] = _attach_error(factor_after_attach)

    def experts_over_cp():  # ep over the dp ranks, the experts sharded over the cp ranks: cp peers vote them
        from torch.distributed.device_mesh import init_device_mesh

        sparse = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("ep", "efsdp"))
        attach(_fsdp_model(fsdp_mesh, data, _config(ep=True), sparse), data["cp"])

    out["experts sharded over the cp ranks"] = _attach_error(experts_over_cp)
    return out


ERRORS = {  # case: (exception, words of its message)
    "ddp": ("NotImplementedError", ["'context_parallel'", "FSDP2", "DDP"]),
    "plain module": ("NotImplementedError", ["'context_parallel'", "FSDP2", "a plain module"]),
    "2-D mesh": ("ValueError", ["'context_parallel'", "2-D DeviceMesh", "mesh['cp']"]),
    "not a mesh": ("TypeError", ["'context_parallel'", "int"]),
    "FSDP over dp alone": ("ValueError", ["context-parallel ranks", "not a part of its FSDP group", "dp_shard x cp"]),
    "HSDP, cp across the nodes": ("ValueError", ["'context_parallel'", "not inside this rank's node"]),
    "l1": ("NotImplementedError", ["'aggregation'='l1'", "context parallelism"]),
    "divide factor 3": ("NotImplementedError", ["divide factor is 3.0", "mean", "sum"]),
    "divide factor 3 after attach": ("NotImplementedError", ["divide factor is 3.0", "reduce-scatter"]),
    "experts sharded over the cp ranks": ("NotImplementedError", ["'context_parallel'", "must span the cp ranks"]),
    "flattened (dp, cp), not told": ("ValueError", ["flattened from one whose 'cp' dim",
                                                     "context_parallel=mesh['cp']"]),
}


def test_bad_context_parallel_arguments_are_clear_errors_on_every_rank():
    per_rank = values(run_ranks("test_fsdp_cp:fsdp_cp_errors", DP * CP, timeout=240))
    for rank, out in enumerate(per_rank):
        assert set(out) == set(ERRORS)
        for case, (kind, words) in ERRORS.items():
            got = out[case]
            assert got is not None, (case, rank)
            assert got[0] == kind, (case, rank, got)
            assert all(w in got[1] for w in words), (case, rank, got[1])
            assert f"rank {rank}" in got[1] or case in ("ddp", "plain module"), (case, rank, got[1])


# -- checkpoints ----------------------------------------------------------------------------------------------


def fsdp_cp_checkpoint(rank, world_size, path):
    """torch's DCP loop (get_state_dict / set_state_dict) after 2 steps, into a fresh model and optimizer
    (other weights and lr): whether 2 more steps give bitwise the uninterrupted run's parameters and
    momenta."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import lionbit

    cfg = _config(aggregation="avg")
    fsdp_mesh, data = _meshes(False)

    def build(fresh):
        model = _fsdp_model(fsdp_mesh, data, cfg)
        if fresh:
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().add_(0.5)
        opt = lionbit.DistributedLion(model.parameters(), aggregation="avg", **LION)
        opt.attach(model, context_parallel=data["cp"])
        if fresh:
            opt.param_groups[0]["lr"] = 0.123
        return model, opt

    def steps(model, opt, which):
        for step in which:
            _loss(model, data, cfg, step, 0).backward()
            opt.step()
            opt.zero_grad()
        return [tp._full(p) for p in model.parameters()], [opt.state[p]["exp_avg"].flatten().tolist()
                                                           for p in model.parameters()]

    model, opt = build(False)
    steps(model, opt, range(2))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    uninterrupted = steps(model, opt, range(2, 4))
    model, opt = build(True)
    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return {"resumed": steps(model, opt, range(2, 4)) == uninterrupted, "momenta": uninterrupted[1]}


def test_fsdp_cp_dcp_checkpoint_resumes_bitwise(tmp_path):
    res = values(run_ranks("test_fsdp_cp:fsdp_cp_checkpoint", DP * CP, kwargs=dict(path=str(tmp_path)),
                           timeout=240))
    assert all(r["resumed"] for r in res), res
    assert res[0]["momenta"] == res[1]["momenta"] != res[2]["momenta"]  # a worker's cp ranks: one momentum
