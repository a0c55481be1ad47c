"""DistributedLion on an MoE model with expert parallelism beside FSDP2
(torchtitan's MoE: the experts split over mesh["ep"], ``fully_shard``-ed
over mesh["dp_mod_ep"]; every block and the root over the whole dp mesh),
on 4 real CPU ranks as dp_mod_ep 2 x ep 2, written as the training script a
user writes.

The reference runs in the same ranks with no lionbit or FSDP code: the same
model under the same expert parallelism alone (each rank's gradients are
then computed by the same kernels on the same values: its own gradient of
every dense parameter, and of its experts the gradient of the tokens its
expert-parallel group routed to them), and Distributed Lion in plain torch:
the dense parameters voted by the 4 ranks, each rank's experts by the 2
ranks that hold them (the dp_mod_ep group), each worker's momentum kept
here. Every step's parameters and every rank's momentum are compared with
it, bitwise."""

import pytest
import torch

from harness import run_ranks, values
from test_fsdp_tp import _full, _gather, _local, check_trajectory, lion_step, single_threaded

DP_MOD_EP, EP = 2, 2  # 4 ranks: the dense parameters' dp group is all of them
M = 2  # HSDP: 2 nodes of (dp_mod_ep 1, ep 2)
V, D, HEADS, H, E, TOP_K, T = 29, 12, 2, 20, 4, 2, 8  # vocabulary, width, heads, expert width, experts, top-k, tokens
LION = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
SCALE = 1024.0  # GradScaler's initial scale


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wqkv = torch.nn.Linear(D, 3 * D)
        self.wo = torch.nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, HEADS, D // HEADS).transpose(1, 2) for y in self.wqkv(x).chunk(3, dim=-1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, D))


class GroupedExperts(torch.nn.Module):
    """torchtitan's experts: E SwiGLU MLPs as three (E, ...) tensors, run one
    expert after the other on the tokens routed to it (grouped by expert)."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(E, D, H) * D ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(E, H, D) * H ** -0.5)
        self.w3 = torch.nn.Parameter(torch.randn(E, D, H) * D ** -0.5)

    def forward(self, x, counts):
        w1, w2, w3 = (w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w2, self.w3))
        out = [torch.nn.functional.silu(xs @ w1[e]) * (xs @ w3[e]) @ w2[e]
               for e, xs in enumerate(torch.split(x, counts.tolist()))]
        return torch.cat(out)


class MoE(torch.nn.Module):
    """Top-k routing over softmax scores; each token's output is the
    scores-weighted sum of its experts' outputs."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(D, E, bias=False)
        self.experts = GroupedExperts()

    def forward(self, x):
        b, t, _ = x.shape
        x = x.reshape(-1, D)
        scores, chosen = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # the (token, k) slots grouped by expert
        counts = torch.bincount(flat, minlength=E)
        y = self.experts(x[order // TOP_K], counts)
        out = torch.zeros_like(y).index_copy(0, order, y).view(-1, TOP_K, D)
        return (out * scores.unsqueeze(-1)).sum(1).view(b, t, D)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = torch.nn.LayerNorm(D)
        self.attention = Attention()
        self.ffn_norm = torch.nn.LayerNorm(D)
        self.moe = MoE()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.ffn_norm(x))


class TinyMoE(torch.nn.Module):
    def __init__(self, block=Block):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(V, D)
        self.layers = torch.nn.ModuleList([block(), block()])
        self.norm = torch.nn.LayerNorm(D)
        self.output = torch.nn.Linear(D, V)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def expert_parallel(experts, ep_mesh):
    """torchtitan's ExpertParallel, in short: the experts' tensors split on
    dim 0 over ``ep_mesh`` (each rank E / EP of them); before the experts
    run, an all-to-all sends every token to the rank of its expert, after it
    another brings the outputs back."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    n, local = ep_mesh.size(), E // ep_mesh.size()
    group = ep_mesh.get_group()

    def partition(name, module, mesh):
        for key, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(key, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))

    def dispatch(module, inputs, mesh):
        routed, counts = inputs
        got = torch.empty_like(counts)
        torch.distributed.all_to_all_single(got, counts, group=group)  # (source rank, local expert) counts
        got = got.view(n, local)
        send, recv = counts.view(n, local).sum(1).tolist(), got.sum(1).tolist()
        tokens = torch.split(all_to_all_single_autograd(routed, recv, send, group), got.reshape(-1).tolist())
        module.ep_splits = (send, recv, got)
        # grouped by local expert, each expert's tokens in the order of their source ranks
        return torch.cat([tokens[s * local + e] for e in range(local) for s in range(n)]), got.sum(0)

    def combine(module, y, mesh):
        send, recv, got = module.ep_splits
        outs = torch.split(y, got.t().reshape(-1).tolist())  # (local expert, source rank)
        back = torch.cat([outs[e * n + s] for s in range(n) for e in range(local)])
        return all_to_all_single_autograd(back, send, recv, group)

    distribute_module(experts, ep_mesh, partition, dispatch, combine)


def _config(**kw):
    cfg = dict(aggregation="vote", steps=4, clip=None, accumulate=1, scaler=False, inf=None, momentum_sync=None,
               shard1=False, dp_mod_ep=DP_MOD_EP, hsdp=False, one_unit=False)
    cfg.update(kw)
    return cfg


# -- the ranks: the user's training script ------------------------------------------------------------------


def _mesh(dp_mod_ep=DP_MOD_EP, hsdp=False):
    """torchtitan's meshes for EP without TP: (dp_mod_ep, ep), the dense parameters' dp over both (dp_mod_ep 1:
    expert parallelism over the whole dp group, whose experts FSDP shards over one rank); ``hsdp``: 2 nodes of
    (dp_mod_ep 1, ep 2), the dense parameters' HSDP mesh (dp_replicate, dp_shard)."""
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        mesh = init_device_mesh("cpu", (M, 1, EP), mesh_dim_names=("dp_replicate", "dp_mod_ep", "ep"))
        mesh["dp_mod_ep", "ep"]._flatten("dp_shard")
        return mesh, mesh["dp_replicate", "dp_shard"]
    mesh = init_device_mesh("cpu", (dp_mod_ep, DP_MOD_EP * EP // dp_mod_ep), mesh_dim_names=("dp_mod_ep", "ep"))
    return mesh, mesh["dp_mod_ep", "ep"]._flatten("dp_shard")


def _hsdp(mesh) -> bool:
    return "dp_replicate" in mesh.mesh_dim_names


def _experts_mesh(mesh):
    """What the experts are fully_shard-ed over: dp_mod_ep; under HSDP (dp_replicate, dp_mod_ep)."""
    return mesh["dp_replicate", "dp_mod_ep"] if _hsdp(mesh) else mesh["dp_mod_ep"]


def _model(ep_mesh):
    torch.manual_seed(0)
    model = TinyMoE()
    for layer in model.layers:
        expert_parallel(layer.moe.experts, ep_mesh)
    return model


def _fsdp_ep_model(mesh, dp, shard1=False, one_unit=False):
    """torchtitan's apply_fsdp with EP: each block's experts over dp_mod_ep, the block over dp, then the root
    (``shard1``: the experts sharded Shard(1), torchtitan's shard_placement_fn where dp_mod_ep x ep exceeds the
    number of experts, and every matrix of the rest too). ``one_unit``: the newest torchtitan's, one unit a
    block whose shard_placement_fn gives the experts their own mesh (torch's ShardPlacementResult)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model = _model(mesh["ep"])
    experts = (lambda p: Shard(1)) if shard1 else None
    dense = (lambda p: Shard(1) if p.ndim == 2 else Shard(0)) if shard1 else None
    for layer in model.layers:
        if one_unit:
            fully_shard(layer, mesh=dp, shard_placement_fn=_per_parameter_mesh(mesh, dp, layer, shard1))
            continue
        fully_shard(layer.moe.experts, mesh=_experts_mesh(mesh), shard_placement_fn=experts)
        fully_shard(layer, mesh=dp, shard_placement_fn=dense)
    fully_shard(model, mesh=dp, shard_placement_fn=dense)
    for module in model.modules():  # torchtitan's disable_fsdp_gradient_division
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    return model


def _per_parameter_mesh(mesh, dp, layer, shard1):
    """torchtitan's shard_placement_fn for a block with EP: the experts on their mesh, the rest on dp's."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    experts_info, dense_info = _get_mesh_info(_experts_mesh(mesh)), _get_mesh_info(dp)
    experts = set(layer.moe.experts.parameters())

    def place(p):
        if p in experts:
            return ShardPlacementResult(Shard(1) if shard1 else Shard(0), experts_info)
        return ShardPlacementResult(Shard(1) if shard1 and p.ndim == 2 else Shard(0), dense_info)

    return place


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randint(0, V, (2, T + 1), generator=g)


def _loss(model, rank, step, micro=0):
    tokens = _batch(rank, step, micro)
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), tokens[:, 1:].reshape(-1))


def _is_expert(p) -> bool:
    return "ep" in (getattr(p, "device_mesh", None) and p.device_mesh.mesh_dim_names or ())


def _clip_with_ep(params, max_norm) -> float:
    """torchtitan's clip_grad_norm_ with EP: the experts' and the other
    gradients' norms apart (their meshes differ), then one total."""
    parts = ([p for p in params if _is_expert(p)], [p for p in params if not _is_expert(p)])
    norms = []
    for part in parts:
        n = torch.nn.utils.get_total_norm([p.grad for p in part if p.grad is not None])
        norms.append(n.full_tensor() if hasattr(n, "full_tensor") else n)
    total = torch.linalg.vector_norm(torch.stack(norms))
    for part in parts:
        torch.nn.utils.clip_grads_with_norm_(part, max_norm, total)
    return total


def _poison(model, cfg, step) -> None:
    """An inf in this rank's part of an expert's gradient where ``cfg["inf"]`` says: [step, rank]."""
    if cfg["inf"] == [step, torch.distributed.get_rank()]:
        with torch.no_grad():
            model.layers[1].moe.experts.w2.grad.to_local().view(-1)[5] = float("inf")


def _train(cfg, mesh, dp):
    import lionbit

    rank = torch.distributed.get_rank()
    model = _fsdp_ep_model(mesh, dp, cfg["shard1"], cfg["one_unit"])
    opt = lionbit.DistributedLion(model.parameters(), aggregation=cfg["aggregation"],
                                  momentum_sync=cfg["momentum_sync"], **LION).attach(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE) if cfg["scaler"] else None
    params = list(model.parameters())
    traj, norms = [], []
    for step in range(cfg["steps"]):
        for micro in range(cfg["accumulate"]):
            model.set_requires_gradient_sync(micro == cfg["accumulate"] - 1)
            loss = _loss(model, rank, step, micro)
            (scaler.scale(loss) if scaler else loss).backward()
        _poison(model, cfg, step)
        if scaler:
            scaler.unscale_(opt)
        if cfg["clip"]:
            norms.append(float(_clip_with_ep(params, cfg["clip"])))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        traj.append([_full(p) for p in params])
    return {
        "traj": traj,
        "norms": norms,
        "steps": opt.steps_taken,
        "momentum": [opt.state[p]["exp_avg"].flatten().tolist() for p in params],
        "experts": [_is_expert(p) for p in params],
        "placements": [str(tuple(p.placements)) for p in params],
    }


# -- the reference: the same expert-parallel model alone, Distributed Lion in plain torch --------------------


def _reference(cfg, run, mesh, dp):
    """Distributed Lion on the expert-parallel model alone: each rank's
    gradients by the same kernels as the FSDP run, clipped by the norm the
    run computed (checked against this reference's own), gathered over the
    workers of each parameter (every rank for the dense ones, the dp_mod_ep
    group for the experts); each worker's momentum kept here; every float32
    operation rounded on its own:
    c = b1 m + (1 - b1) g, m = b2 m + (1 - b2) g, x = x (1 - lr wd) - lr Delta.
    HSDP: a worker is a node; its gradient the sum (torchtitan's divide
    factor 1.0) of its ranks' (a dense parameter's over the node's 2 ranks,
    an expert's its one rank's), gathered over the replicate group; each
    rank keeps its shard (FSDP's chunk of dim 0) of its node's momentum."""
    dist = torch.distributed
    rank = dist.get_rank()
    model = _model(mesh["ep"])
    params = list(model.parameters())
    hsdp = _hsdp(mesh)
    # per parameter: the ranks that sum their gradients into a worker's (HSDP), the group of the workers
    nodes = [(mesh["dp_mod_ep"] if _is_expert(p) else mesh["dp_shard"]).get_group() if hsdp else None
             for p in params]
    groups = [mesh["dp_replicate"].get_group() if hsdp else (mesh["dp_mod_ep"] if _is_expert(p) else dp).get_group()
              for p in params]
    workers = [dist.get_world_size(g) for g in groups]
    momentum = [[torch.zeros_like(_local(p)) for _ in range(n)] for p, n in zip(params, workers)]
    report = {"traj": [], "norm_rel_err": 0.0, "applied": 0}
    for step in range(cfg["steps"]):
        model.zero_grad(set_to_none=True)
        for micro in range(cfg["accumulate"]):
            loss = _loss(model, rank, step, micro)
            (loss * SCALE if cfg["scaler"] else loss).backward()  # a power of 2: exact
        if cfg["scaler"]:
            for p in params:
                p.grad.div_(SCALE)
        _poison(model, cfg, step)
        grads = [_local(p.grad).clone() for p in params]
        finite = torch.tensor([all(bool(torch.isfinite(g).all()) for g in grads)], dtype=torch.int32)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            report["traj"].append("skipped")
            continue
        if cfg["clip"]:
            own = float(_clip_with_ep(params, float("inf")))  # (max_norm inf: the norm, nothing clipped)
            ran = run["norms"][step]
            report["norm_rel_err"] = max(report["norm_rel_err"], abs(ran - own) / own)
            coef = torch.clamp(cfg["clip"] / (torch.tensor(ran, dtype=torch.float32) + 1e-6), max=1.0)
            grads = [g * coef for g in grads]
        if hsdp:  # the node's sum, the parts in rank order (two at most: the order cannot matter)
            grads = [_node_sum(g, node) for g, node in zip(grads, nodes)]
        for i, p in enumerate(params):
            lion_step(_local(p), _gather(grads[i], groups[i]), momentum[i], cfg["aggregation"])
        report["applied"] += 1
        report["traj"].append([_full(p) for p in params])
    dims = [1 if cfg["shard1"] and (_is_expert(p) or p.dim() == 2) else 0 for p in params]  # FSDP's shard dims
    report["momentum"] = [_own_block(momentum[i][dist.get_rank(groups[i])], nodes[i], dims[i]).flatten().tolist()
                          for i in range(len(params))]
    return report


def _node_sum(g, node):
    parts = _gather(g, node)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _own_block(t, node, dim):
    """Under HSDP this rank's block of its node's tensor (FSDP's chunk of ``dim`` over the node's ranks)."""
    if node is None:
        return t
    return torch.chunk(t, torch.distributed.get_world_size(node), dim=dim)[torch.distributed.get_rank(node)]


def fsdp_ep_runs(rank, world_size, configs):
    import lionbit

    meshes = {}
    out = []
    for cfg in configs:
        key = (cfg["dp_mod_ep"], cfg["hsdp"])
        if key not in meshes:
            meshes[key] = _mesh(*key)
        mesh, dp = meshes[key]
        # the groups of the votes: the dense parameters' and the experts'; HSDP: the replicate group's
        groups = (mesh["dp_replicate"].get_group(),) * 2 if cfg["hsdp"] else (dp.get_group(),
                                                                               mesh["dp_mod_ep"].get_group())
        for group in groups:
            lionbit.reset_stats(group)
        run = _train(cfg, mesh, dp)
        run["stats"], run["expert_stats"] = map(lionbit.stats, groups)
        run["ref"] = single_threaded(_reference, cfg, run, mesh, dp) if cfg["momentum_sync"] is None else None
        out.append(run)
    return out


# -- the tests ------------------------------------------------------------------------------------------------

CONFIGS = {
    "vote, top-2 routing, torchtitan's clip with EP": _config(clip=0.5),
    "avg, accumulation, GradScaler, an inf in rank 3's part of an expert's gradient": _config(
        aggregation="avg", accumulate=2, scaler=True, inf=[1, 3]),
    "vote, momentum_sync=2": _config(momentum_sync=2),
    "vote, experts and matrices sharded Shard(1), clip, accumulation": _config(shard1=True, clip=0.5, accumulate=2),
    "vote, EP over the whole dp group (dp_mod_ep 1 x ep 4), clip": _config(dp_mod_ep=1, clip=0.5),
    "HSDP + EP (2 nodes of ep 2): vote": _config(hsdp=True, dp_mod_ep=1),
    "HSDP + EP: avg, accumulation, GradScaler, an inf in rank 3's part of an expert's gradient": _config(
        hsdp=True, dp_mod_ep=1, aggregation="avg", accumulate=2, scaler=True, inf=[1, 3]),
    "HSDP + EP: vote, experts and matrices sharded Shard(1)": _config(hsdp=True, dp_mod_ep=1, shard1=True),
}


ONE_UNIT_CONFIGS = {  # the newest torchtitan's: one FSDP unit a block, the experts' mesh per parameter
    "one unit a block: vote, clip": _config(one_unit=True, clip=0.5),
    "one unit a block: Shard(1), avg, GradScaler, an inf in rank 3's part of an expert's gradient": _config(
        one_unit=True, shard1=True, aggregation="avg", scaler=True, inf=[1, 3]),
    "one unit a block, HSDP: vote": _config(one_unit=True, hsdp=True, dp_mod_ep=1),
}


def _per_parameter_meshes() -> bool:
    """Whether this torch's shard_placement_fn can choose a parameter's mesh (ShardPlacementResult)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult  # noqa: F401
    except ImportError:
        return False
    return True


ALL_CONFIGS = {**CONFIGS, **(ONE_UNIT_CONFIGS if _per_parameter_meshes() else {})}


@pytest.fixture(scope="module")
def runs():
    return values(run_ranks("test_fsdp_ep:fsdp_ep_runs", DP_MOD_EP * EP,
                            kwargs=dict(configs=list(ALL_CONFIGS.values())), timeout=240))


@pytest.mark.parametrize("name", [n for n, c in {**CONFIGS, **ONE_UNIT_CONFIGS}.items() if c["momentum_sync"] is None])
def test_fsdp_ep_equals_the_reference_bitwise(runs, name):
    if name not in ALL_CONFIGS:
        pytest.skip("this torch's shard_placement_fn cannot choose a parameter's mesh (no ShardPlacementResult)")
    i = list(ALL_CONFIGS).index(name)
    cfg = ALL_CONFIGS[name]
    per_rank = [r[i] for r in runs]
    for rank, run in enumerate(per_rank):
        ref = run["ref"]
        assert run["traj"] == per_rank[0]["traj"], rank  # every rank holds the same parameters
        check_trajectory(name, rank, run, ref)
        assert run["momentum"] == ref["momentum"], (name, rank)  # its own (experts: its dp_mod_ep worker's)
        assert run["steps"] == ref["applied"] == cfg["steps"] - (1 if cfg["inf"] else 0)
        if cfg["clip"]:
            assert ref["norm_rel_err"] < 1e-5, ref["norm_rel_err"]
        if cfg["hsdp"]:  # the replicas' 1-bit all-reduces of their shards between the nodes, no reduce-scatter
            st = run["stats"]
            assert run["steps"] <= st["sign_allreduce_calls"] <= 2 * cfg["steps"], st
            assert not st["sign_reduce_scatter_calls"], st
            continue
        # one 1-bit reduce-scatter a step over each group: the dense parameters' (4 ranks), the experts' (2):
        # (N-1)/N of the bits and the header rounds' 72 bytes a peer, far below FSDP's fp32 reduce-scatter
        for n, st in ((DP_MOD_EP * EP, run["stats"]), (cfg["dp_mod_ep"], run["expert_stats"])):
            if n == 1:  # (each rank alone holds its experts: no one to vote with)
                assert st["bytes_sent"] == 0, st
                continue
            calls = st["sign_reduce_scatter_calls"]
            assert run["steps"] <= calls <= cfg["steps"], st
            if not cfg["inf"]:  # (a skipped step's vote stops in its header round)
                assert st["bytes_sent"] - st["zero_bytes_sent"] <= (n - 1) * (st["elements"] / n / 8 + 80 * calls), st
            assert st["bytes_sent"] * 4 < (n - 1) / n * 4 * st["elements"], st
    # FSDP shards as configured: the experts Shard(1) over dp_mod_ep, split Shard(0) over ep
    placed = [pl for pl, expert in zip(per_rank[0]["placements"], per_rank[0]["experts"]) if expert]
    want = "(" + ("Replicate(), " if cfg["hsdp"] else "") + ("Shard(dim=1)" if cfg["shard1"] else "_StridedShard(dim=0")
    assert all(pl.startswith(want) and pl.endswith("Shard(dim=0))") for pl in placed), placed
    # the experts' momenta differ between the dp_mod_ep workers (their own data); the ranks of a worker
    # (rank r and r + EP) hold the same experts
    experts = per_rank[0]["experts"]
    assert any(experts) and not all(experts)
    k = experts.index(True)
    if cfg["dp_mod_ep"] > 1:
        assert per_rank[0]["momentum"][k] != per_rank[EP]["momentum"][k]


def test_momentum_sync_averages_each_mesh_over_its_own_workers(runs):
    """A momentum synchronization averages the dense momenta over every rank
    and each expert's over the ranks that hold it."""
    i = list(CONFIGS).index("vote, momentum_sync=2")
    per_rank = [r[i] for r in runs]
    experts = per_rank[0]["experts"]
    for k, expert in enumerate(experts):
        ms = [r["momentum"][k] for r in per_rank]
        if not expert:
            assert all(m == ms[0] for m in ms), k
        else:  # ranks r and r + EP hold the same experts, ranks r and r + 1 others
            assert ms[0] == ms[EP] and ms[1] == ms[1 + EP] and ms[0] != ms[1], k
    assert all(r["traj"] == per_rank[0]["traj"] for r in per_rank)



# -- checkpoints, and what attach refuses ---------------------------------------------------------------------

K, J = 3, 2  # steps before the checkpoint, after it


def attach_for_resume(model, seed):
    """A DistributedLion on the FSDP model; ``seed`` 1: other weights and lr (all must come from the checkpoint)."""
    import lionbit

    if seed:
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().add_(0.5)
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    if seed:
        opt.param_groups[0]["lr"] = 0.123
    return model, opt


def resume_steps(model, opt, steps, batch):
    """Steps with an lr change at step K - 1 (``batch``: whose batch this rank trains on); the parameters,
    momenta and lr after them."""
    for step in steps:
        if step == K - 1:
            opt.param_groups[0]["lr"] = 0.005
        _loss(model, batch, step).backward()
        opt.step()
        opt.zero_grad()
    return ([_full(p) for p in model.parameters()], [opt.state[p]["exp_avg"].flatten().tolist()
                                                      for p in model.parameters()], opt.param_groups[0]["lr"])


def resumes(rank, path, build, batch) -> dict:
    """After K steps of ``build(seed)``'s model and optimizer, torchtitan's
    checkpoint (the model's and the flattened optimizer's state dicts
    through DCP), and a consolidated optimizer file (``full_state_dict``:
    every worker's momentum stacked) that every rank reads and hands to
    set_optimizer_state_dict as it is; each read into a fresh model and
    optimizer: whether J more steps give bitwise the uninterrupted run's
    parameters and every rank's momentum."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    where = os.path.join(path, "step3")
    model, opt = build(0)
    resume_steps(model, opt, range(K), batch)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=flat)},
             checkpoint_id=where)
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save(full, where + ".pt")
    torch.distributed.barrier()
    uninterrupted = resume_steps(model, opt, range(K, K + J), batch)
    out = {"momenta": uninterrupted[1]}
    for mode in ("dcp", "consolidated"):
        model, opt = build(1)
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=flat)}
        dcp.load(sd, checkpoint_id=where)
        set_model_state_dict(model, sd["model"])
        if mode == "dcp":
            set_optimizer_state_dict(model, opt, sd["optim"], options=flat)
        else:
            set_optimizer_state_dict(model, opt, torch.load(where + ".pt", weights_only=False))
        out[mode] = resume_steps(model, opt, range(K, K + J), batch) == uninterrupted
    return out


CHECKPOINTS = {  # (HSDP, Shard(1))
    "dp_mod_ep 2 x ep 2": (False, False),
    "HSDP, 2 nodes of ep 2, Shard(1)": (True, True),
}


def fsdp_ep_checkpoint(rank, world_size, path, hsdp, shard1):
    mesh, dp = _mesh(1 if hsdp else DP_MOD_EP, hsdp)
    return resumes(rank, path, lambda seed: attach_for_resume(_fsdp_ep_model(mesh, dp, shard1), seed), rank)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_fsdp_ep_checkpoint_resumes_bitwise(tmp_path, name):
    hsdp, shard1 = CHECKPOINTS[name]
    res = values(run_ranks("test_fsdp_ep:fsdp_ep_checkpoint", DP_MOD_EP * EP,
                           kwargs=dict(path=str(tmp_path), hsdp=hsdp, shard1=shard1), timeout=240))
    assert all(r["dcp"] and r["consolidated"] for r in res), res
    # each rank resumed its own momenta: the dense ones differ between the workers (HSDP: between the nodes)
    other = EP if hsdp else 1
    assert res[0]["momenta"][0] != res[other]["momenta"][0]


def fsdp_ep_refusals(rank, world_size):
    """What attach refuses, as a clear error on every rank: experts sharded
    over a sub-mesh without expert parallelism (no dim beside it spans the
    dp group)."""
    from torch.distributed.fsdp import fully_shard

    import lionbit

    mesh, dp = _mesh()
    torch.manual_seed(0)
    model = TinyMoE()
    for layer in model.layers:
        fully_shard(layer.moe.experts, mesh=mesh["dp_mod_ep"])
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    try:
        lionbit.DistributedLion(model.parameters(), **LION).attach(model)
        return "no error"
    except NotImplementedError as err:
        return str(err)


def test_fsdp_ep_refuses_what_it_cannot_vote():
    for r in values(run_ranks("test_fsdp_ep:fsdp_ep_refusals", DP_MOD_EP * EP, timeout=240)):
        assert "are sharded over different meshes" in r and "efsdp x ep" in r, r
