"""DistributedLion on an MoE with tensor and expert parallelism beside FSDP2,
on torchtitan's meshes for it: the dense (fsdp, tp) and the sparse (efsdp,
ep) over the same ranks, efsdp x ep = fsdp x tp, so the expert-parallel group
spans the tensor-parallel ranks; 4 real CPU ranks as dp 2 x tp 2, with
ep 2 (efsdp 2) and ep 4 (efsdp 1: every expert on one rank), and HSDP as
2 nodes of tp 2 (ep 2). Written as the training script a user writes.

Each block's attention is split over tp (torch's ColwiseParallel and
RowwiseParallel); its MoE takes this tensor-parallel rank's part of the
sequence (torchtitan's MoE under TP: each tp rank routes other tokens, and
the tokens of the whole ep group meet at the experts), with the router
replicated over tp (its gradient summed over the tp ranks, as a sequence-
parallel norm's), and gives its outputs back to every tp rank.

The reference runs in the same ranks with no lionbit or FSDP code: the same
model under the same tensor and expert parallelism alone (each rank's
gradients by the same kernels), and Distributed Lion in plain torch: each
dense parameter's tensor-parallel part voted by the dp ranks that hold it,
each rank's experts by its efsdp group (one rank: its own direction), each
worker's momentum kept here. Every step's parameters and every rank's
momentum are compared with it, bitwise."""

import pytest
import torch

import test_fsdp_ep as ep
import test_fsdp_tp as tp
from harness import run_ranks, values

DP, TP = 2, 2
D, E, V = ep.D, ep.E, ep.V
LION = ep.LION
SCALE = ep.SCALE


class Split(torch.autograd.Function):
    """This tensor-parallel rank's part of x along ``dim`` (``gather``:
    every rank's parts back, put together); the backward of either is the
    other. Sequence parallelism's scatter and gather."""

    @staticmethod
    def forward(ctx, x, group, dim, gather):
        ctx.group, ctx.dim, ctx.gather = group, dim, gather
        return _all_parts(x, group, dim) if gather else _own_part(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        back = _own_part(g, ctx.group, ctx.dim) if ctx.gather else _all_parts(g, ctx.group, ctx.dim)
        return back, None, None, None


def _own_part(x, group, dim):
    return x.chunk(group.size(), dim=dim)[group.rank()].contiguous()


def _all_parts(x, group, dim):
    parts = [torch.empty_like(x) for _ in range(group.size())]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class Router(torch.nn.Linear):
    """The router, replicated over tp (a DTensor, Replicate()): each tp
    rank's gradient is its tokens' part of the sum."""

    def __init__(self):
        super().__init__(D, E, bias=False)

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Partial

        w = self.weight
        if isinstance(w, DTensor):
            w = w.to_local(grad_placements=(Partial(),))
        return torch.nn.functional.linear(x, w)


class Block(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.attention_norm = torch.nn.LayerNorm(D)
        self.attention = tp.Attention()
        self.ffn_norm = torch.nn.LayerNorm(D)
        self.moe = ep.MoE()
        self.moe.router = Router()
        self.tp = group

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        part = Split.apply(self.ffn_norm(x), self.tp, 1, False)  # this tp rank's part of the sequence
        return x + Split.apply(self.moe(part), self.tp, 1, True)


def _config(**kw):
    cfg = dict(ep=2, hsdp=False, aggregation="vote", steps=4, accumulate=1, scaler=False, inf=None)
    cfg.update(kw)
    return cfg


# -- the ranks: the user's training script ------------------------------------------------------------------


def _meshes(ep_size, hsdp=False):
    """torchtitan's dense and sparse meshes, each an unflattening of the ranks: (fsdp, tp) and (efsdp, ep);
    ``hsdp``: 2 nodes, (dp_replicate 2, fsdp 1, tp 2) and (dp_replicate 2, efsdp 1, ep 2)."""
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return (init_device_mesh("cpu", (DP, 1, TP), mesh_dim_names=("dp_replicate", "fsdp", "tp")),
                init_device_mesh("cpu", (DP, 1, ep_size), mesh_dim_names=("dp_replicate", "efsdp", "ep")))
    dense = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("fsdp", "tp"))
    sparse = init_device_mesh("cpu", (DP * TP // ep_size, ep_size), mesh_dim_names=("efsdp", "ep"))
    return dense, sparse


def _hsdp(mesh) -> bool:
    return "dp_replicate" in mesh.mesh_dim_names


def _dp_index(dense) -> int:
    """Whose batch a rank trains on: its dp index's (its tensor-parallel ranks take the same batch)."""
    return dense["dp_replicate" if _hsdp(dense) else "fsdp"].get_local_rank()


def _fsdp_mesh(mesh, name):
    return mesh["dp_replicate", name] if _hsdp(mesh) else mesh[name]


def _model(dense, sparse):
    """The model, the attention's plan over tp, the router replicated over tp, the experts over ep."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    group = dense["tp"].get_group()
    model = ep.TinyMoE(lambda: Block(group))
    for layer in model.layers:
        parallelize_module(layer.attention, dense["tp"], {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                                          "wv": ColwiseParallel(), "wo": RowwiseParallel()})
        router = layer.moe.router
        router.weight = torch.nn.Parameter(distribute_tensor(router.weight.data, dense["tp"], [Replicate()]))
        ep.expert_parallel(layer.moe.experts, sparse["ep"])
    return model


def _fsdp_model(dense, sparse):
    """torchtitan's apply_fsdp with EP: each block's experts over efsdp, the block over dp, then the root."""
    from torch.distributed.fsdp import fully_shard

    model = _model(dense, sparse)
    for layer in model.layers:
        fully_shard(layer.moe.experts, mesh=_fsdp_mesh(sparse, "efsdp"))
        fully_shard(layer, mesh=_fsdp_mesh(dense, "fsdp"))
    fully_shard(model, mesh=_fsdp_mesh(dense, "fsdp"))
    for module in model.modules():  # torchtitan's disable_fsdp_gradient_division
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    return model


def _train(cfg, dense, sparse):
    import lionbit

    dp = _dp_index(dense)
    model = _fsdp_model(dense, sparse)
    opt = lionbit.DistributedLion(model.parameters(), aggregation=cfg["aggregation"], **LION).attach(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE) if cfg["scaler"] else None
    params = list(model.parameters())
    traj = []
    for step in range(cfg["steps"]):
        for micro in range(cfg["accumulate"]):
            model.set_requires_gradient_sync(micro == cfg["accumulate"] - 1)
            loss = ep._loss(model, dp, step, micro)
            (scaler.scale(loss) if scaler else loss).backward()
        ep._poison(model, cfg, step)
        if scaler:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        traj.append([tp._full(p) for p in params])
    return {
        "traj": traj,
        "steps": opt.steps_taken,
        "momentum": [opt.state[p]["exp_avg"].flatten().tolist() for p in params],
        "experts": [ep._is_expert(p) for p in params],
        "placements": [str(tuple(p.placements)) for p in params],
        "names": [name for name, _ in model.named_parameters()],
    }


# -- the reference: the same model alone, Distributed Lion in plain torch ---------------------------------------


def _reference(cfg, dense, sparse):
    """Each rank's gradients by the same kernels as the FSDP run (its
    tensor-parallel part of a dense parameter's, the router's summed over
    tp; its experts'), gathered over the workers of each parameter (the dp
    group for a dense one, the efsdp group for the experts); each worker's
    momentum kept here (test_fsdp_tp.lion_step)."""
    dist = torch.distributed
    dp = _dp_index(dense)
    model = _model(dense, sparse)
    params = list(model.parameters())
    # the workers: HSDP's nodes (of one shard rank here: a node's gradient is its rank's)
    dense_workers, expert_workers = (dense["dp_replicate"], sparse["dp_replicate"]) if _hsdp(dense) else (
        dense["fsdp"], sparse["efsdp"])
    groups = [(expert_workers if ep._is_expert(p) else dense_workers).get_group() for p in params]
    workers = [dist.get_world_size(g) for g in groups]
    momentum = [[torch.zeros_like(tp._local(p)) for _ in range(n)] for p, n in zip(params, workers)]
    report = {"traj": [], "applied": 0}
    for step in range(cfg["steps"]):
        model.zero_grad(set_to_none=True)
        for micro in range(cfg["accumulate"]):
            loss = ep._loss(model, dp, step, micro)
            (loss * SCALE if cfg["scaler"] else loss).backward()  # a power of 2: exact
        grads = [tp._tp_local_grad(p).clone() for p in params]
        if cfg["scaler"]:
            grads = [g.div_(SCALE) for g in grads]
        if cfg["inf"] == [step, dist.get_rank()]:
            i = [id(p) for p in params].index(id(model.layers[1].moe.experts.w2))
            grads[i].view(-1)[5] = float("inf")
        finite = torch.tensor([all(bool(torch.isfinite(g).all()) for g in grads)], dtype=torch.int32)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            report["traj"].append("skipped")
            continue
        for i, p in enumerate(params):
            tp.lion_step(tp._local(p), tp._gather(grads[i], groups[i]), momentum[i], cfg["aggregation"])
        report["applied"] += 1
        report["traj"].append([tp._full(p) for p in params])
    report["momentum"] = [momentum[i][dist.get_rank(groups[i])].flatten().tolist() for i in range(len(params))]
    return report


def _vote_groups(dense, sparse):
    """The groups of the votes: the dense parameters' (dp) and the experts' (efsdp); HSDP: the replicate groups."""
    if _hsdp(dense):
        return dense["dp_replicate"].get_group(), sparse["dp_replicate"].get_group()
    return dense["fsdp"].get_group(), sparse["efsdp"].get_group()


def fsdp_ep_tp_runs(rank, world_size, configs):
    import lionbit

    out = []
    for cfg in configs:
        dense, sparse = _meshes(cfg["ep"], cfg["hsdp"])
        groups = _vote_groups(dense, sparse)
        for group in groups:
            lionbit.reset_stats(group)
        run = _train(cfg, dense, sparse)
        run["stats"], run["expert_stats"] = map(lionbit.stats, groups)
        run["ref"] = tp.single_threaded(_reference, cfg, dense, sparse)
        out.append(run)
    return out


# -- the tests ------------------------------------------------------------------------------------------------

CONFIGS = {
    "ep 2 (efsdp 2): vote": _config(),
    "ep 2 (efsdp 2): avg, 2 micro-batches, GradScaler, an inf in rank 2's part of an expert's gradient": _config(
        aggregation="avg", accumulate=2, scaler=True, inf=[1, 2]),
    "ep 4 (efsdp 1: each expert on one rank): vote": _config(ep=4),
    "HSDP, 2 nodes of tp 2 and ep 2: avg, GradScaler, an inf in rank 3's part of an expert's gradient": _config(
        hsdp=True, aggregation="avg", scaler=True, inf=[2, 3]),
}


@pytest.fixture(scope="module")
def runs():
    per_rank = values(run_ranks("test_fsdp_ep_tp:fsdp_ep_tp_runs", DP * TP,
                                kwargs=dict(configs=list(CONFIGS.values())), timeout=300))
    return {name: [r[i] for r in per_rank] for i, name in enumerate(CONFIGS)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp_ep_tp_equals_the_reference_bitwise(runs, name):
    cfg = CONFIGS[name]
    per_rank = runs[name]
    for rank, run in enumerate(per_rank):
        ref = run["ref"]
        assert run["traj"] == per_rank[0]["traj"], rank  # every rank holds the same parameters
        tp.check_trajectory(name, rank, run, ref)
        assert run["momentum"] == ref["momentum"], (name, rank)  # its own part of its worker's
        assert run["steps"] == ref["applied"] == cfg["steps"] - (cfg["inf"] is not None)
        # a 1-bit collective a step over each group (HSDP: all-reduces between the nodes)
        for n, st in ((DP, run["stats"]), (1 if cfg["hsdp"] else DP * TP // cfg["ep"], run["expert_stats"])):
            if cfg["hsdp"]:
                assert run["steps"] <= st["sign_allreduce_calls"] <= cfg["steps"], st
                assert not st["sign_reduce_scatter_calls"], st
                continue
            if n == 1:  # (each rank alone holds its experts: no one to vote with)
                assert st["bytes_sent"] == 0, st
                continue
            assert run["steps"] <= st["sign_reduce_scatter_calls"] <= cfg["steps"], st
            assert st["bytes_sent"] * 4 < (n - 1) / n * 4 * st["elements"], st
    experts = per_rank[0]["experts"]
    assert any(experts) and not all(experts)
    # the tensor-parallel ranks of a worker hold other parts of the attention and other experts
    wq = per_rank[0]["names"].index("layers.0.attention.wq.weight")
    assert per_rank[0]["momentum"][wq] != per_rank[1]["momentum"][wq]
    k = experts.index(True)
    assert per_rank[0]["momentum"][k] != per_rank[1]["momentum"][k]
    assert per_rank[0]["traj"][0] != per_rank[0]["traj"][-1]  # the parameters moved


# -- checkpoints ----------------------------------------------------------------------------------------------

def fsdp_ep_tp_checkpoint(rank, world_size, path, cfg):
    """test_fsdp_ep's resume: torchtitan's DCP checkpoint and a consolidated file, each bitwise."""
    dense, sparse = _meshes(cfg["ep"], cfg["hsdp"])
    return ep.resumes(rank, path, lambda seed: ep.attach_for_resume(_fsdp_model(dense, sparse), seed),
                      _dp_index(dense))


CHECKPOINTS = {"ep 2": _config(), "HSDP, 2 nodes of tp 2 and ep 2": _config(hsdp=True)}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_fsdp_ep_tp_checkpoint_resumes_bitwise(tmp_path, name):
    res = values(run_ranks("test_fsdp_ep_tp:fsdp_ep_tp_checkpoint", DP * TP,
                           kwargs=dict(path=str(tmp_path), cfg=CHECKPOINTS[name]), timeout=240))
    assert all(r["dcp"] and r["consolidated"] for r in res), res
    # each rank resumed its own momenta: the tensor-parallel ranks' parts and the workers' differ
    assert res[0]["momenta"][0] != res[2]["momenta"][0]
