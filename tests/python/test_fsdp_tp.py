"""DistributedLion on FSDP2 with tensor parallelism (torchtitan's 2-D
parallelism: ``fully_shard`` over the "dp" dim of a (dp, tp) mesh, the
blocks' linears split over "tp"), on 4 real CPU ranks as dp 2 x tp 2,
written as the training script a user writes.

The reference runs in the same ranks, with no lionbit or FSDP code: the
same model under the same tensor-parallel plan alone (each rank's gradient
is then computed by the same tensor-parallel kernels on the same parameter
values), and Distributed Lion with 2 workers in plain torch: every dp rank's
tensor-parallel-local gradient gathered over the dp group, each worker's
momentum and direction, the vote, the update. Every step's parameters and
every rank's momentum are compared with it, bitwise."""

import math

import pytest
import torch

import test_hsdp_dcp
from harness import run_ranks, values

DP, TP = 2, 2  # the 1-D FSDP mesh's dp ranks, tensor-parallel ranks
M, L = 2, 2  # HSDP: nodes, shard ranks a node (each with TP tensor-parallel ranks: 8 ranks)
# vocabulary, width, heads, MLP width, tokens (19 and 17 rows a tensor-parallel rank: FSDP pads them)
V, D, HEADS, H, T = 38, 12, 2, 34, 8
LION = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
SCALE = 1024.0  # GradScaler's initial scale


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (torch.nn.Linear(D, D) for _ in range(3))
        self.wo = torch.nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        # heads from the local width: tensor parallelism gives each rank HEADS / TP of them
        q, k, v = (w(x).view(b, t, -1, D // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))


class FeedForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(D, H)
        self.w2 = torch.nn.Linear(H, D)

    def forward(self, x):
        return self.w2(torch.nn.functional.gelu(self.w1(x)))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = torch.nn.LayerNorm(D)
        self.attention = Attention()
        self.ffn_norm = torch.nn.LayerNorm(D)
        self.feed_forward = FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(torch.nn.Module):
    """A two-block causal transformer LM named as torchtitan's Llama."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(V, D)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.LayerNorm(D)
        self.output = torch.nn.Linear(D, V)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def tensor_parallel(model, tp_mesh, sequence=True):
    """torchtitan's tensor-parallel plan for Llama (``sequence``: with its
    sequence parallelism: norms and the residual stream sharded on the
    sequence dim); without it, the blocks' linears only."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if sequence:
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    for layer in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)) if sequence else RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)) if sequence else RowwiseParallel(),
        }
        if sequence:
            plan |= {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        parallelize_module(layer, tp_mesh, plan)
    return model


def _batch(dp_rank, step, micro=0):
    g = torch.Generator().manual_seed(10_000 * step + 100 * dp_rank + micro)
    return torch.randint(0, V, (4, T + 1), generator=g)


def _loss(model, dp_rank, step, micro=0):
    tokens = _batch(dp_rank, step, micro)
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), tokens[:, 1:].reshape(-1))


def _config(**kw):
    cfg = dict(aggregation="vote", steps=4, clip=None, accumulate=1, reshard=True, sequence=True, scaler=False,
               inf=None)
    cfg.update(kw)
    return cfg


# -- the ranks: the user's training script ------------------------------------------------------------------


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def _hsdp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (M, L, TP), mesh_dim_names=("replicate", "shard", "tp"))


def _hsdp(mesh) -> bool:
    return "replicate" in mesh.mesh_dim_names


def _fsdp_mesh(mesh):
    """What fully_shard shards over: the dp dim, or HSDP's (replicate, shard) dims."""
    return mesh["replicate", "shard"] if _hsdp(mesh) else mesh["dp"]


def _dp_index(mesh) -> int:
    """Whose batch a rank trains on: its dp rank's (its tensor-parallel ranks take the same batch)."""
    if _hsdp(mesh):
        return mesh["replicate"].get_local_rank() * L + mesh["shard"].get_local_rank()
    return mesh["dp"].get_local_rank()


def _workers(mesh):
    """The group of the vote, one rank a worker: dp; HSDP: the replicate group (a worker is a node)."""
    return (mesh["replicate"] if _hsdp(mesh) else mesh["dp"]).get_group()


def _model(mesh, cfg):
    torch.manual_seed(0)
    return tensor_parallel(TinyLlama(), mesh["tp"], cfg["sequence"])


def _fsdp_tp_model(mesh, cfg):
    """torchtitan's order: the tensor-parallel plan, then fully_shard over dp, block by block, then the root
    (``cfg["replicate"]``: FSDP2's replicate() in its place, the newest torchtitan's DDP beside TP)."""
    from torch.distributed.fsdp import fully_shard

    model = _model(mesh, cfg)
    if cfg.get("replicate"):
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for layer in model.layers:
            replicate(layer, mesh=mesh["dp"])
        replicate(model, mesh=mesh["dp"])
        for module in model.modules():  # torchtitan's disable_fsdp_gradient_division
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
        return model
    for layer in model.layers:
        fully_shard(layer, mesh=_fsdp_mesh(mesh), reshard_after_forward=cfg["reshard"])
    return fully_shard(model, mesh=_fsdp_mesh(mesh), reshard_after_forward=cfg["reshard"])


def _poison(model, mesh, cfg, step) -> None:
    """An inf in this rank's tensor-parallel part of one gradient (the first
    ColwiseParallel weight's), where ``cfg["inf"]`` says: [step, rank]."""
    if cfg["inf"] == [step, torch.distributed.get_rank()]:
        with torch.no_grad():
            model.layers[0].attention.wq.weight.grad.to_local().view(-1)[3] = float("inf")


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).flatten().tolist()


def _train(mesh, cfg, model=None, opt=None, steps=None):
    import lionbit

    dp = _dp_index(mesh)
    if model is None:
        model = _fsdp_tp_model(mesh, cfg)
        opt = lionbit.DistributedLion(model.parameters(), aggregation=cfg["aggregation"], **LION).attach(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE) if cfg["scaler"] else None
    traj, norms = [], []
    for step in steps or range(cfg["steps"]):
        for micro in range(cfg["accumulate"]):
            model.set_requires_gradient_sync(micro == cfg["accumulate"] - 1)
            loss = _loss(model, dp, step, micro)
            (scaler.scale(loss) if scaler else loss).backward()
        _poison(model, mesh, cfg, step)
        if scaler:
            scaler.unscale_(opt)
        if cfg["clip"]:  # torchtitan's clip: the total norm over the mesh (here: this dp rank's gradient's)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        traj.append([_full(p) for p in model.parameters()])
    return {
        "traj": traj,
        "norms": norms,
        "steps": opt.steps_taken,
        "momentum": [opt.state[p]["exp_avg"].flatten().tolist() for p in model.parameters()],
        "state_numel": sum(s["exp_avg"].numel() for s in opt.state.values()),
        # each parameter's tensor-parallel-local shape (FSDP's unsharded tensor)
        "full_shapes": [list(lionbit.torch_internals.fsdp2_orig_size(fp)) for fp in opt.attachment.managed.values()],
    }


# -- the reference: the same tensor-parallel model alone, Distributed Lion in plain torch ---------------------


def _f32(x):
    return torch.tensor(x, dtype=torch.float32)


def _tp_local_grad(p):
    """p's tensor-parallel-local gradient, placed as p (a SequenceParallel
    norm's Partial gradient summed over the tp group, as FSDP does)."""
    g = p.grad
    if hasattr(g, "redistribute"):
        g = g.redistribute(placements=p.placements).to_local()
    return g


def _gather(t, group) -> list:
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return parts


def _worker_grads(mesh, grads) -> list:
    """Per parameter, every worker's gradient: each dp rank's; under HSDP
    each node's mean, (a + b) / 2 in float32 over its two shard ranks, as
    FSDP averages them (with 2 ranks the order cannot matter)."""
    if not _hsdp(mesh):
        return [_gather(g, mesh["dp"].get_group()) for g in grads]
    out = []
    for g in grads:
        a, b = _gather(g, mesh["shard"].get_group())
        out.append(_gather((a + b) / 2, mesh["replicate"].get_group()))
    return out


def _own_shard(mesh, t):
    """Under HSDP this rank's rows of a tensor-parallel-local tensor (FSDP's chunk of dim 0)."""
    if not _hsdp(mesh):
        return t
    rows = -(-t.shape[0] // L)
    shard = mesh["shard"].get_local_rank()
    return t[shard * rows : (shard + 1) * rows]


def _reference(mesh, cfg, run):
    """Distributed Lion with 2 workers on the tensor-parallel model alone
    (the dp ranks; under HSDP the nodes, with their mean gradients). Each
    rank computes its dp rank's gradient with the same tensor-parallel
    kernels as the FSDP run; the workers' tensor-parallel-local gradients
    are gathered, and every worker's momentum is kept here; every float32
    operation rounded on its own:
    c = b1 m + (1 - b1) g, m = b2 m + (1 - b2) g, x = x (1 - lr wd) - lr Delta.
    Clipping: each worker clips its gradient by its own norm, the one the
    run computed (checked against this reference's float64 norm)."""
    dist = torch.distributed
    workers = _workers(mesh)
    dp = _dp_index(mesh)
    model = _model(mesh, cfg)
    params = list(model.parameters())
    momentum = [[torch.zeros_like(_local(p)) for p in params] for _ in range(DP)]
    b1, b2 = LION["betas"]
    lr, wd = LION["lr"], LION["weight_decay"]
    report = {"traj": [], "norm_rel_err": 0.0, "applied": 0}
    for step in range(cfg["steps"]):
        model.zero_grad(set_to_none=True)
        for micro in range(cfg["accumulate"]):  # accumulated by autograd, as a tensor-parallel script does
            loss = _loss(model, dp, step, micro)
            (loss * SCALE if cfg["scaler"] else loss).backward()  # a power of 2: exact
        grads = [_tp_local_grad(p).clone() for p in params]
        if cfg["scaler"]:
            grads = [g / SCALE for g in grads]
        _poison_grads(grads, params, model, cfg, step)
        everyone = _worker_grads(mesh, grads)  # per parameter, every worker's gradient
        finite = torch.tensor([all(bool(torch.isfinite(g).all()) for g in grads)], dtype=torch.int32)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # (the reference's own agreement: every rank)
        if not finite.item():
            report["traj"].append("skipped")
            continue
        if cfg["clip"]:
            mine = dist.get_rank(workers)
            own = _full_norm(model, [parts[mine] for parts in everyone], params)
            ran = run["norms"][step]
            report["norm_rel_err"] = max(report["norm_rel_err"], abs(ran - own) / own)
            norms = _gather(torch.tensor([ran], dtype=torch.float32), workers)
            for w in range(DP):
                coef = torch.clamp(cfg["clip"] / (norms[w][0] + 1e-6), max=1.0)
                everyone = [[g * coef if r == w else g for r, g in enumerate(parts)] for parts in everyone]
        with torch.no_grad():
            for i, p in enumerate(params):
                dirs = []
                for w in range(DP):
                    m, g = momentum[w][i], everyone[i][w]
                    dirs.append(torch.sign(torch.add(torch.mul(m, _f32(b1)), torch.mul(g, _f32(1.0 - b1)))))
                    momentum[w][i] = torch.add(torch.mul(m, _f32(b2)), torch.mul(g, _f32(1.0 - b2)))
                total = dirs[0] + dirs[1]
                delta = total / DP if cfg["aggregation"] == "avg" else torch.sign(total)
                x = _local(p)
                x.copy_(torch.sub(torch.mul(x, _f32(1.0 - lr * wd)), torch.mul(delta, _f32(lr))))
        report["applied"] += 1
        report["traj"].append([_full(p) for p in params])
    report["momentum"] = [_own_shard(mesh, m).flatten().tolist() for m in momentum[dist.get_rank(workers)]]
    return report


@torch.no_grad()
def lion_step(x, grads, momenta, aggregation) -> None:
    """Distributed Lion on one parameter's local tensor x: worker w's
    gradient grads[w] and momentum momenta[w] (updated in place of the
    list), the vote (or the mean of the signs), the update; every float32
    operation rounded on its own:
    c = b1 m + (1 - b1) g, m = b2 m + (1 - b2) g, x = x (1 - lr wd) - lr Delta."""
    b1, b2 = LION["betas"]
    lr, wd = LION["lr"], LION["weight_decay"]
    total = 0
    for w, g in enumerate(grads):
        m = momenta[w]
        total = total + torch.sign(torch.add(torch.mul(m, _f32(b1)), torch.mul(g, _f32(1.0 - b1))))
        momenta[w] = torch.add(torch.mul(m, _f32(b2)), torch.mul(g, _f32(1.0 - b2)))
    delta = total / len(grads) if aggregation == "avg" else torch.sign(total)
    x.copy_(torch.sub(torch.mul(x, _f32(1.0 - lr * wd)), torch.mul(delta, _f32(lr))))


def check_trajectory(name, rank, run, ref) -> None:
    """A run's parameters after every step against its reference's (a step
    the reference skipped left the parameters as they were)."""
    for step, (got, want) in enumerate(zip(run["traj"], ref["traj"])):
        if want == "skipped":
            assert got == (run["traj"][step - 1] if step else None), f"{name}: step {step} skipped changed params"
            continue
        bad = [k for k, (a, b) in enumerate(zip(got, want)) if a != b]
        assert not bad, f"{name}: rank {rank}, step {step}: parameters {bad} differ"


def single_threaded(reference, *args):
    """A reference on one thread (the run's kernels' results do not depend on it; the host's load does)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference(*args)
    finally:
        torch.set_num_threads(threads)


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _poison_grads(grads, params, model, cfg, step) -> None:
    if cfg["inf"] == [step, torch.distributed.get_rank()]:
        i = [id(p) for p in params].index(id(model.layers[0].attention.wq.weight))
        grads[i].view(-1)[3] = float("inf")


def _full_norm(model, grads, params) -> float:
    """This dp rank's gradient's norm in float64, its tensor-parallel parts gathered."""
    total = 0.0
    for g, p in zip(grads, params):
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import DTensor

            g = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        total += float(torch.sum(g.double() ** 2))
    return total ** 0.5


def fsdp_tp_runs(rank, world_size, configs, hsdp=False):
    import lionbit

    mesh = _hsdp_mesh() if hsdp else _mesh()
    out = []
    for cfg in configs:
        lionbit.reset_stats(_workers(mesh))
        run = _train(mesh, cfg)
        run["stats"] = lionbit.stats(_workers(mesh))
        # this rank's chunk in FSDP's layout: each parameter's tensor-parallel-local dim 0 padded to
        # a multiple of the shard ranks (dp on a 1-D mesh)
        n = L if hsdp else DP
        run["chunk"] = sum(-(-s[0] // n) * (math.prod(s) // s[0]) for s in run["full_shapes"])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            run["ref"] = _reference(mesh, cfg, run)
        finally:
            torch.set_num_threads(threads)
        out.append(run)
    return out


# -- the tests ------------------------------------------------------------------------------------------------

CONFIGS = {
    "vote, clip, torchtitan's plan with sequence parallelism": _config(clip=0.5),
    "avg, accumulation, reshard_after_forward=False": _config(aggregation="avg", accumulate=2, reshard=False),
    "vote, GradScaler, an inf in rank 3's part of a gradient": _config(scaler=True, inf=[1, 3]),
    "vote, the blocks' linears alone split (embedding, norms, head on dp only)": _config(sequence=False),
}


REPLICATE_CONFIGS = {  # FSDP2's replicate() over dp beside TP, on the (dp, tp) mesh of 2 x 2 ranks
    "replicate() + TP: vote, clip": _config(clip=0.5, replicate=True),
    "replicate() + TP: avg, accumulation, GradScaler, an inf in rank 3's part of a gradient": _config(
        aggregation="avg", accumulate=2, scaler=True, inf=[1, 3], replicate=True),
}


HSDP_CONFIGS = {  # on the (replicate, shard, tp) mesh of 2 x 2 x 2 ranks
    "HSDP + TP: vote, clip": _config(clip=0.5),
    "HSDP + TP: avg, accumulation, GradScaler, an inf in rank 3's part of a gradient": _config(
        aggregation="avg", accumulate=2, scaler=True, inf=[1, 3]),
}


@pytest.fixture(scope="module")
def runs():
    return values(run_ranks("test_fsdp_tp:fsdp_tp_runs", DP * TP, kwargs=dict(configs=list(CONFIGS.values())),
                            timeout=240))


@pytest.fixture(scope="module")
def replicate_runs():
    return values(run_ranks("test_fsdp_tp:fsdp_tp_runs", DP * TP,
                            kwargs=dict(configs=list(REPLICATE_CONFIGS.values())), timeout=240))


@pytest.fixture(scope="module")
def hsdp_runs():
    return values(run_ranks("test_fsdp_tp:fsdp_tp_runs", M * L * TP,
                            kwargs=dict(configs=list(HSDP_CONFIGS.values()), hsdp=True), timeout=400))


def _check_bitwise(name, cfg, per_rank) -> None:
    for rank, run in enumerate(per_rank):
        ref = run["ref"]
        # every rank holds the same full parameters after every step
        assert run["traj"] == per_rank[0]["traj"], rank
        check_trajectory(name, rank, run, ref)
        # each rank's momentum is its worker's, the tensor-parallel part (HSDP: FSDP's shard of it)
        assert run["momentum"] == ref["momentum"], (name, rank)
        assert run["steps"] == ref["applied"] == cfg["steps"] - (1 if cfg["inf"] else 0)
        if cfg["clip"]:
            assert ref["norm_rel_err"] < 1e-5, ref["norm_rel_err"]
    # the momentum is 1/TP of the model's (plus the parameters no plan splits), HSDP: 1/(L TP)
    d = sum(p.numel() for p in TinyLlama().parameters())
    assert all(r["state_numel"] < d for r in per_rank)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp_tp_equals_the_reference_bitwise(runs, name):
    i = list(CONFIGS).index(name)
    cfg = CONFIGS[name]
    _check_bitwise(name, cfg, [r[i] for r in runs])
    # one 1-bit reduce-scatter a step over the dp group: the signs of this rank's tensor-parallel part
    for r in runs:
        st, s = r[i]["stats"], r[i]["chunk"]
        calls = st["sign_reduce_scatter_calls"]
        assert r[i]["steps"] <= calls <= cfg["steps"], st  # (a skipped step's vote, stopped in its header round)
        signs = (DP - 1) * 8 * -(-s // 64) + 72 * (DP - 1)  # (N-1)/N of the N chunks' bits, the header round
        if not cfg["inf"]:
            assert st["bytes_sent"] - st["zero_bytes_sent"] == calls * signs, (st, s)
        assert st["bytes_sent"] * 16 < (DP - 1) * 4 * s * calls, st  # FSDP's fp32 reduce-scatter


def _check_all_reduce_votes(name, cfg, per_rank, workers, elements) -> None:
    """Bitwise against the reference, and one 1-bit all-reduce a step over ``workers`` ranks of this rank's
    ``elements(run)`` momentum elements (no reduce-scatter), far below an fp32 all-reduce's bytes."""
    _check_bitwise(name, cfg, per_rank)
    for run in per_rank:
        st = run["stats"]
        calls = st["sign_allreduce_calls"]
        assert run["steps"] <= calls <= cfg["steps"] and st["sign_reduce_scatter_calls"] == 0, st
        assert st["bytes_sent"] * 16 < 2 * (workers - 1) / workers * 4 * elements(run) * calls, st


@pytest.mark.parametrize("name", list(REPLICATE_CONFIGS))
def test_replicate_tp_equals_the_reference_bitwise(replicate_runs, name):
    """FSDP2's replicate(): the dp group votes this rank's whole tensor-parallel part."""
    i = list(REPLICATE_CONFIGS).index(name)
    _check_all_reduce_votes(name, REPLICATE_CONFIGS[name], [r[i] for r in replicate_runs], DP,
                            lambda run: run["state_numel"])


@pytest.mark.parametrize("name", list(HSDP_CONFIGS))
def test_hsdp_tp_equals_the_reference_bitwise(hsdp_runs, name):
    """HSDP: the replicate group votes this rank's shard of its tensor-parallel part."""
    i = list(HSDP_CONFIGS).index(name)
    _check_all_reduce_votes(name, HSDP_CONFIGS[name], [r[i] for r in hsdp_runs], M, lambda run: run["chunk"])


# -- checkpoints, a non-finite gradient, and what attach refuses ---------------------------------------------

K, J = 3, 2
MODES = ("plain", "sharded", "full", "full, read by every rank")
# under HSDP (8 ranks, the slowest): DCP (torchtitan's) and the file every rank reads (lionbit splits each row);
# test_hsdp_dcp covers every mode on HSDP alone, the 1-D case here every mode with tensor parallelism
HSDP_MODES = ("sharded", "full, read by every rank")


def _build(mesh, seed, lr=None):
    import lionbit

    torch.manual_seed(seed)
    model = _fsdp_tp_model(mesh, _config())
    if seed:  # other weights: everything must come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().add_(0.5)
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    if lr is not None:
        opt.param_groups[0]["lr"] = lr
    return model, opt


def _state(model, opt):
    params = [_full(p) for p in model.parameters()]
    momenta = [opt.state[p]["exp_avg"].flatten().tolist() for p in model.parameters()]
    return params, momenta, opt.param_groups[0]["lr"]


def _load(model, opt, mode, where):
    """test_hsdp_dcp's loads; and the consolidated file read by every rank,
    its momenta handed to lionbit as they are (each rank takes its row and
    its tensor-parallel part of it); the model from rank 0 (torch's own
    set_model_state_dict cannot split a full tensor into a _StridedShard)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if mode != "full, read by every rank":
        return test_hsdp_dcp._load(model, opt, mode, where)
    sd = torch.load(where + ".pt", weights_only=False)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, sd["model"] if torch.distributed.get_rank() == 0 else {}, options=options)
    set_optimizer_state_dict(model, opt, sd["optim"])


def _run(model, opt, mesh, steps):
    dp = _dp_index(mesh)
    for step in steps:
        if step == K - 1:
            opt.param_groups[0]["lr"] = 0.005
        _loss(model, dp, step).backward()
        opt.step()
        opt.zero_grad()


def fsdp_tp_checkpoints(rank, world_size, path, hsdp=False):
    import os

    mesh = _hsdp_mesh() if hsdp else _mesh()
    modes = HSDP_MODES if hsdp else MODES
    written = {mode: mode.split(",")[0] for mode in modes}  # (the file every rank reads is "full"'s)
    # one run, saved in every format after step K, then run on
    model, opt = _build(mesh, 0)
    _run(model, opt, mesh, range(K))
    for kind in dict.fromkeys(written.values()):
        test_hsdp_dcp._save(model, opt, rank, kind, os.path.join(path, kind))
    _run(model, opt, mesh, range(K, K + J))
    uninterrupted = _state(model, opt)
    out = {}
    for mode in modes:
        model, opt = _build(mesh, 1, lr=0.123)
        _load(model, opt, mode, os.path.join(path, written[mode]))
        _run(model, opt, mesh, range(K, K + J))
        out[mode] = {"same": _state(model, opt) == uninterrupted, "momentum": uninterrupted[1][3][:6]}
    if hsdp:
        return out
    # the consolidated file on 4 dp ranks (tp 1): every dp rank starts from the mean of the 2 saved momenta
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    wide = init_device_mesh("cpu", (DP * TP, 1), mesh_dim_names=("dp", "tp"))
    model, opt = _build(wide, 0)
    full = torch.load(os.path.join(path, "full.pt"), weights_only=False)["optim"]
    saved = {name: st["exp_avg"].clone() for name, st in full["state"].items()}
    set_optimizer_state_dict(model, opt, full)
    out["dp_change"] = {}
    for name, rows in opt.sharded_state_dict()["momentum"].items():
        rows, want = rows.full_tensor().double(), saved[name].double()
        assert want.shape[0] == DP and rows.shape[0] == DP * TP, (name, want.shape, rows.shape)
        out["dp_change"][name] = [float((rows[r] - want.mean(0)).abs().max() / want.abs().max()) for r in
                                  range(DP * TP)] + [all(torch.equal(rows[r], rows[0]) for r in range(DP * TP))]
    return out


@pytest.mark.parametrize("hsdp", [False, True], ids=["dp 2 x tp 2", "HSDP 2 x 2 x tp 2"])
def test_fsdp_tp_checkpoints_resume_bitwise(tmp_path, hsdp):
    ranks = M * L * TP if hsdp else DP * TP
    res = values(run_ranks("test_fsdp_tp:fsdp_tp_checkpoints", ranks, kwargs=dict(path=str(tmp_path), hsdp=hsdp),
                           timeout=400))
    for mode in HSDP_MODES if hsdp else MODES:
        for rank, r in enumerate(res):
            assert r[mode]["same"], (mode, rank)
        # the workers' momenta differ (their own data)
        assert res[0][mode]["momentum"] != res[ranks // 2][mode]["momentum"]
    if hsdp:
        return
    for rank, r in enumerate(res):  # the mean to float32's rounding, the same bits on every dp rank
        assert r["dp_change"] and all(d[-1] and max(d[:-1]) <= 2 ** -22 for d in r["dp_change"].values()), \
            (rank, r["dp_change"])


def _consolidated(model, opt) -> dict:
    """Every rank's parameters and momenta, gathered: {name: full tensor},
    {name: (dp ranks, *shape) momentum rows} (torch's full_state_dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    params = {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}
    optim = get_optimizer_state_dict(model, opt, options=options)
    return {"params": params, "momenta": {k: st["exp_avg"].clone() for k, st in optim["state"].items()}}


def fsdp_tp_reshard(rank, world_size, path, tp):
    """Writes (on dp 2 x tp 2) or reads (on dp 2 x ``tp``; tp 0: FSDP with no
    tensor parallelism at all) a DCP checkpoint; returns whether what was
    read is what was written, every rank's momentum row and every parameter
    bitwise, and whether a step then runs."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import lionbit

    where = os.path.join(path, "ckpt")
    if world_size == DP * TP:  # the writer
        model, opt = _build(_mesh(), 0)
        _run(model, opt, _mesh(), range(K))
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=where)
        written = _consolidated(model, opt)
        if rank == 0:
            torch.save(written, os.path.join(path, "written.pt"))
        torch.distributed.barrier()
        return {}
    if tp:
        mesh = init_device_mesh("cpu", (DP, tp), mesh_dim_names=("dp", "tp"))
        model, opt = _build(mesh, 1, lr=0.123)
    else:
        from torch.distributed.fsdp import fully_shard

        mesh = None
        torch.manual_seed(1)
        model = TinyLlama()
        for layer in model.layers:
            fully_shard(layer)
        model = fully_shard(model)
        opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=where)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    read = _consolidated(model, opt)
    written = torch.load(os.path.join(path, "written.pt"), weights_only=False)
    same = (read["params"].keys() == written["params"].keys() and read["momenta"].keys() == written["momenta"].keys()
            and all(torch.equal(read["params"][k], v) for k, v in written["params"].items())
            and all(torch.equal(read["momenta"][k], v) for k, v in written["momenta"].items()))
    dp = torch.distributed.get_rank() if mesh is None else _dp_index(mesh)
    _loss(model, dp, K).backward()
    opt.step()
    return {"same": same, "lr": opt.param_groups[0]["lr"], "steps": opt.steps_taken,
            "rows": sorted({tuple(v.shape[:1]) for v in read["momenta"].values()})}


def test_fsdp_tp_checkpoint_loads_at_another_tp_size(tmp_path):
    """A DCP checkpoint of dp 2 x tp 2 loads on dp 2 x tp 1 and on FSDP over 2
    ranks without tensor parallelism (the momentum rows are DTensors of the
    parameters' global shapes: DCP reshards them): every dp rank's momentum
    and every parameter as written, bitwise, and training goes on."""
    run_ranks("test_fsdp_tp:fsdp_tp_reshard", DP * TP, kwargs=dict(path=str(tmp_path), tp=TP), timeout=240)
    for tp in (1, 0):
        res = values(run_ranks("test_fsdp_tp:fsdp_tp_reshard", DP, kwargs=dict(path=str(tmp_path), tp=tp),
                               timeout=240))
        for rank, r in enumerate(res):
            assert r["same"] and r["lr"] == 0.005 and r["steps"] == K + 1 and r["rows"] == [[DP]], (tp, rank, r)


def fsdp_tp_cases(rank, world_size):

    import lionbit

    mesh = _mesh()
    out = {}
    # An inf in one rank's tensor-parallel part of a gradient, no GradScaler: every rank raises naming it,
    # nothing changed on any rank (its tensor-parallel peer holds other parts of the same worker), training goes on.
    model, opt = _build(mesh, 0)
    params = list(model.parameters())

    def state():
        return [p.to_local().clone() for p in params] + [opt.state[p]["exp_avg"].clone() for p in params]

    _run(model, opt, mesh, [0])
    before = state()
    _loss(model, mesh["dp"].get_local_rank(), 1).backward()
    _poison(model, mesh, _config(inf=[1, 3]), 1)
    try:
        opt.step()
        out["inf"] = "no error"
    except RuntimeError as err:
        out["inf"] = str(err)
    out["inf_changed_nothing"] = all(torch.equal(a, b) for a, b in zip(before, state()))
    opt.zero_grad()
    _run(model, opt, mesh, [2])
    out["steps_after"] = opt.steps_taken

    # FSDP1 beside tensor parallelism: refused, naming FSDP2
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(tensor_parallel(TinyLlama(), mesh["tp"], sequence=False), device_mesh=mesh["dp"],
                 device_id=torch.device("cpu"), use_orig_params=True)
    try:
        lionbit.DistributedLion(model.parameters(), **LION).attach(model)
        out["fsdp1"] = "no error"
    except NotImplementedError as err:
        out["fsdp1"] = str(err)

    # refused at attach, naming the argument: "l1" (a per-tensor scale of a split tensor), a hierarchy
    for case, kw in (("hierarchy", dict(hierarchy="node")), ("l1", dict(aggregation="l1"))):
        model = _fsdp_tp_model(mesh, _config())
        try:
            lionbit.DistributedLion(model.parameters(), **kw, **LION).attach(model)
            out[case] = "no error"
        except (ValueError, NotImplementedError) as err:
            out[case] = str(err)

    return out


def test_fsdp_tp_non_finite_and_refusals():
    res = values(run_ranks("test_fsdp_tp:fsdp_tp_cases", DP * TP, timeout=240))
    for rank, r in enumerate(res):
        assert f"DistributedLion.step on rank {rank}: non-finite gradient (inf or NaN) on rank(s) [3]" in r["inf"], r
        assert "no parameter or momentum changed on any rank" in r["inf"], r
        assert r["inf_changed_nothing"] and r["steps_after"] == 2, r
        assert "argument 'hierarchy'='node' is not supported with tensor parallelism" in r["hierarchy"], r
        assert (f"DistributedLion.attach (FSDP1) on rank {rank}: FSDP instance '<root>' shards over a device mesh "
                f"sliced out of a larger one (tensor parallelism beside FSDP1), which is not supported") \
            in r["fsdp1"], r
        assert (f"argument 'aggregation'='l1' is not supported with tensor parallelism (rank {rank}, mesh 2 (dp) x 2 "
                f"(tensor parallel))") in r["l1"], r
