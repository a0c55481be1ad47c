"""DistributedLion on HSDP (FSDP2's fully_shard over a 2-D (replicate, shard)
mesh), on 4 real CPU ranks as 2 nodes x 2 ranks, written as the training
script a user writes. Each node is one Distributed Lion worker: FSDP's own
reduce-scatter inside the node gives each rank its shard of the node's mean
gradient (p.grad), each rank keeps its shard of the node's momentum, and the
shard's direction is voted over the replicate group.

The reference is an independent single-process simulation of Distributed
Lion with M = 2 workers whose gradients are their nodes' mean gradients
(:func:`_reference`, written here with plain torch, not with lionbit's code):
every run is compared with it step by step, bitwise."""


import pytest
import torch

from harness import run_ranks, values

M, L = 2, 2  # nodes, ranks per node
V, D, H, T = 37, 12, 33, 9  # vocabulary, width, MLP width, tokens per sequence (dim 0s that FSDP pads)
LION = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
SCALE = 1024.0  # GradScaler's initial scale


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(D)
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.proj = torch.nn.Linear(D, D)
        self.ln2 = torch.nn.LayerNorm(D)
        self.up = torch.nn.Linear(D, H)
        self.down = torch.nn.Linear(H, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, D))
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class TinyLM(torch.nn.Module):
    """A two-block causal transformer LM (2,971 parameters; ``tie``: the
    head's weight is the embedding's, as GPT-2's)."""

    def __init__(self, tie=False):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, V)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _model(seed=0, tie=False):
    torch.manual_seed(seed)
    return TinyLM(tie)


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randint(0, V, (4, T + 1), generator=g)


def _loss(model, rank, step, micro=0):
    tokens = _batch(rank, step, micro)
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), tokens[:, 1:].reshape(-1))


def _config(**kw):
    cfg = dict(aggregation="vote", tie_break="zero", steps=4, clip=None, accumulate=1, reshard=True, mp=None,
               reduce=None, scaler=False, overflow=None, compile=False, tie=False, divide=None, double_buffer=False)
    cfg.update(kw)
    return cfg


# -- the ranks: the user's training script ---------------------------------------------------------


def _hsdp_model(mesh, cfg, seed=0):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = dict(mesh=mesh, reshard_after_forward=cfg["reshard"])
    if cfg["mp"]:
        reduce = getattr(torch, cfg["reduce"]) if cfg.get("reduce") else None
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg["mp"]), reduce_dtype=reduce)
    model = _model(seed, cfg.get("tie", False))
    for block in model.blocks:
        if cfg["compile"]:  # torchtitan's order: compile each block, then shard it
            block.compile()
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    if cfg.get("divide"):  # torchtitan's disable_fsdp_gradient_division (FSDP reduces with PREMUL_SUM)
        for unit in list(model.blocks) + [model]:
            unit.set_gradient_divide_factor(cfg["divide"])
            if cfg.get("force_sum"):  # the sum forced, the division after it
                unit.set_force_sum_reduction_for_comms(True)
    return model


def _train(rank, mesh, cfg):
    import lionbit

    model = _hsdp_model(mesh, cfg)
    opt = lionbit.DistributedLion(model.parameters(), aggregation=cfg["aggregation"], tie_break=cfg["tie_break"],
                                  double_buffer=cfg["double_buffer"], **LION)
    opt.attach(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE) if cfg["scaler"] else None
    traj, norms, grads, ptrs = [], [], [], []
    for step in range(cfg["steps"]):
        for micro in range(cfg["accumulate"]):
            model.set_requires_gradient_sync(micro == cfg["accumulate"] - 1)
            loss = _loss(model, rank, step, micro)
            if cfg["overflow"] == [step, rank]:
                loss = loss * 1e38
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if cfg.get("grads"):  # this rank's shard of its node's mean gradient, as step() reads it
            grads.append({n: p.grad.to_local().flatten().tolist() for n, p in model.named_parameters()})
        if cfg["clip"]:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        traj.append([p.full_tensor().flatten().tolist() for p in model.parameters()])
        ptrs.append([s["exp_avg"].data_ptr() for s in opt.state.values()])
    local = {n: p.to_local() for n, p in model.named_parameters()}
    return {
        "traj": traj,
        "norms": norms,
        "grads": grads,
        "steps": opt.steps_taken,
        "replayed": opt.attachment.plan.replayed,
        "plannable": lionbit.kernel_choice.list_kernels_allowed("cpu"),  # (not with LIONBIT_KERNELS=aten)
        "momentum": {n: opt.state[p]["exp_avg"].flatten().tolist() for n, p in model.named_parameters()},
        "local": {n: t.flatten().tolist() for n, t in local.items()},
        "state_bytes": sum(s["exp_avg"].numel() * s["exp_avg"].element_size() for s in opt.state.values()),
        # the steps after the first whose momenta moved to other storage (double_buffer's swaps)
        "swapped": [all(map(int.__ne__, a, b)) for a, b in zip(ptrs, ptrs[1:])],
    }


def hsdp_runs(rank, world_size, configs):
    """Every config on the 2 x 2 mesh; the same model on a 1-D mesh of 4 for
    the momentum's size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lionbit

    mesh = init_device_mesh("cpu", (M, L), mesh_dim_names=("replicate", "shard"))
    out = {"runs": [_train(rank, mesh, cfg) for cfg in configs]}
    flat = _model()
    for block in flat.blocks:
        fully_shard(block)
    fully_shard(flat)
    opt = lionbit.DistributedLion(flat.parameters(), **LION).attach(flat)
    _loss(flat, rank, 0).backward()
    opt.step()
    out["flat_state_bytes"] = sum(s["exp_avg"].numel() * s["exp_avg"].element_size() for s in opt.state.values())
    return out


# -- the reference: M workers, each with its node's mean gradient; plain torch ---------------------


def _f32(x):
    return torch.tensor(x, dtype=torch.float32)


def _default_reduce_dtype(param_dtype):
    """What FSDP2 reduces in under a policy that names no reduce_dtype: the
    gradients' own dtype (param_dtype) on torch 2.11, the sharded
    parameter's (float32: no rounding to model) from torch 2.12 on."""
    from lionbit import torch_internals

    return param_dtype if torch_internals.generation() == "2.11" else None


def _node_grads(params, step, cfg):
    """Each node's mean gradient (a dict name -> tensor), as the node's
    ranks compute their local gradients on the full parameters (in bf16
    under the mixed-precision policy) and FSDP averages them:
    (g_a + g_b) / 2 in float32, the reduction's dtype (FSDP casts bf16
    gradients to the sharded parameters' float32 before it reduces), or
    rounded once to ``reduce`` where the policy reduces in it. With 2 ranks
    the float order cannot matter: a + b = b + a, and / 2 is exact."""
    model = _model(tie=cfg.get("tie", False))
    dtype = getattr(torch, cfg["mp"]) if cfg["mp"] else torch.float32
    model.to(dtype)
    out = []
    for node in range(M):
        local = []
        for shard in range(L):
            rank = node * L + shard
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(params[n].to(dtype))
            model.zero_grad(set_to_none=True)
            for micro in range(cfg["accumulate"]):
                loss = _loss(model, rank, step, micro)
                if cfg["overflow"] == [step, rank]:
                    loss = loss * 1e38
                (loss * SCALE if cfg["scaler"] else loss).backward()  # a power of 2: exact, unless it overflows
            local.append({n: p.grad / SCALE if cfg["scaler"] else p.grad.clone() for n, p in model.named_parameters()})
        mean = {n: (local[0][n].float() + local[1][n].float()) / (cfg.get("divide") or 2) for n in params}
        reduce = cfg.get("reduce") or _default_reduce_dtype(cfg["mp"])
        if reduce:  # reduced in that dtype: the node's mean rounded to it once (/ 2 is exact)
            mean = {n: g.to(getattr(torch, reduce)).float() for n, g in mean.items()}
        out.append(mean)
    return out


def _reference(cfg, run):
    """Distributed Lion with M workers, step by step, from the same initial
    parameters; every float32 operation rounded on its own:
    c = b1 m + (1 - b1) g, m = b2 m + (1 - b2) g, x = x (1 - lr wd) - lr Delta.
    Clipping: each worker clips its gradient by its own norm, which the run
    computed over the node's shards in its own float order; the reference
    takes that norm from the run (checked against its own float64 norm) so
    that the comparison stays bitwise. "random" ties: the run's signs where
    the workers tie (any of +1/-1), checked elsewhere to be a tie."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulate(cfg, run)
    finally:
        torch.set_num_threads(threads)


def _simulate(cfg, run):
    names = [n for n, _ in _model(tie=cfg.get("tie", False)).named_parameters()]
    params = {n: p.detach().clone() for n, p in _model(tie=cfg.get("tie", False)).named_parameters()}
    momentum = [{n: torch.zeros_like(p) for n, p in params.items()} for _ in range(M)]
    b1, b2 = LION["betas"]
    lr, wd = LION["lr"], LION["weight_decay"]
    applied = 0
    report = {"steps": [], "norm_rel_err": 0.0, "random_ties": 0}
    for step in range(cfg["steps"]):
        grads = _node_grads(params, step, cfg)
        if cfg["scaler"] and not all(torch.isfinite(g).all() for node in grads for g in node.values()):
            report["steps"].append("skipped")
            assert run["traj"][step] == [params[n].flatten().tolist() for n in names], "skipped step changed params"
            continue
        if cfg["clip"]:
            for node in range(M):
                own = torch.linalg.vector_norm(torch.cat([grads[node][n].double().flatten() for n in names]))
                ran = run["norms"][node][step]
                report["norm_rel_err"] = max(report["norm_rel_err"], abs(ran - own.item()) / own.item())
                coef = torch.clamp(cfg["clip"] / (_f32(ran) + 1e-6), max=1.0)
                for n in names:
                    grads[node][n] = grads[node][n] * coef
        votes = {}
        for n in names:
            dirs = []
            for node in range(M):
                m, g = momentum[node][n], grads[node][n]
                dirs.append(torch.sign(torch.add(torch.mul(m, _f32(b1)), torch.mul(g, _f32(1.0 - b1)))))
                momentum[node][n] = torch.add(torch.mul(m, _f32(b2)), torch.mul(g, _f32(1.0 - b2)))
            total = dirs[0] + dirs[1]
            if cfg["aggregation"] == "avg":
                votes[n] = total / M
                continue
            delta = torch.sign(total)
            tie = (total == 0) & ((dirs[0] != 0) | (dirs[1] != 0))
            if cfg["tie_break"] == "alternate":
                delta[tie] = 1.0 if applied % 2 == 0 else -1.0
            elif cfg["tie_break"] == "random":
                # the run's sign where the workers tie: +1 or -1, read back from its parameters
                after = torch.tensor(run["traj"][step][names.index(n)]).view_as(params[n])
                plus = torch.sub(torch.mul(params[n], _f32(1.0 - lr * wd)), _f32(lr))
                minus = torch.add(torch.mul(params[n], _f32(1.0 - lr * wd)), _f32(lr))
                picked = torch.where(after == plus, 1.0, torch.where(after == minus, -1.0, float("nan")))
                delta[tie] = picked[tie]
                report["random_ties"] += int(tie.sum())
            votes[n] = delta
        for n in names:
            params[n] = torch.sub(torch.mul(params[n], _f32(1.0 - lr * wd)), torch.mul(votes[n], _f32(lr)))
        applied += 1
        report["steps"].append([params[n].flatten().tolist() for n in names])
    report["momentum"] = [{n: m.flatten().tolist() for n, m in node.items()} for node in momentum]
    report["applied"] = applied
    return report


def _chunk(t: torch.Tensor, shard: int) -> torch.Tensor:
    """FSDP's shard of a parameter's dim 0 (torch.chunk's split)."""
    rows = -(-t.shape[0] // L)
    return t[shard * rows : (shard + 1) * rows]


# -- the test -----------------------------------------------------------------------------------------

CONFIGS = {
    "vote": _config(),
    "vote+alternate, clip, accumulation, reshard_after_forward=False": _config(
        tie_break="alternate", clip=0.5, accumulate=2, reshard=False),
    "avg": _config(aggregation="avg"),
    "vote+random, GradScaler with an overflow on rank 3": _config(tie_break="random", scaler=True, overflow=[2, 3]),
    # DistributedLion(double_buffer=True): the next momenta written in the directions' pass, swapped in
    "vote, clip, accumulation, double_buffer": _config(clip=0.5, accumulate=2, double_buffer=True),
    "vote, GradScaler with an overflow on rank 3, double_buffer": _config(scaler=True, overflow=[2, 3],
                                                                          double_buffer=True),
    "bf16 MixedPrecisionPolicy": _config(mp="bfloat16"),
    "bf16 MixedPrecisionPolicy reduced in bf16 (accelerate's)": _config(mp="bfloat16", reduce="bfloat16"),
    "vote, clip, torch.compile per block": _config(clip=0.5, compile=True),
    "vote, the head tied to the embedding": _config(tie=True),
    "vote, clip, FSDP's division off (torchtitan's factor 1.0: the node's sum)": _config(clip=0.5, divide=1.0),
    "avg, FSDP's division by 4 with the sum forced": _config(aggregation="avg", divide=4.0, force_sum=True),
}


@pytest.fixture(scope="module")
def runs():
    configs = list(CONFIGS.values())
    res = values(run_ranks("test_hsdp:hsdp_runs", M * L, kwargs=dict(configs=configs), timeout=240))
    return res


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hsdp_equals_the_m_worker_reference_bitwise(runs, name):
    i = list(CONFIGS).index(name)
    cfg = CONFIGS[name]
    per_rank = [r["runs"][i] for r in runs]
    # every rank holds the same full parameters after every step (replicas and shards agree)
    assert all(r["traj"] == per_rank[0]["traj"] for r in per_rank)
    # double_buffer: each applied step swapped the second buffers in (a skipped one did not); else none
    skipped = cfg["overflow"][0] if cfg["overflow"] else None
    want = [cfg["double_buffer"] and step != skipped for step in range(1, cfg["steps"])]
    assert all(r["swapped"] == want for r in per_rank), (name, [r["swapped"] for r in per_rank])
    run = dict(per_rank[0])
    run["norms"] = [per_rank[node * L]["norms"] for node in range(M)]  # each node's own clipping norm
    ref = _reference(cfg, run)
    shapes = {n: p.shape for n, p in _model(tie=cfg.get("tie", False)).named_parameters()}
    names = list(shapes)
    assert len(names) == len(run["traj"][0])
    for step, (got, want) in enumerate(zip(run["traj"], ref["steps"])):
        if want == "skipped":
            continue
        for n, a, b in zip(names, got, want):
            if cfg["compile"]:  # compiled kernels round differently: a flipped vote moves an element 2 lr a step
                worst = max(abs(x - y) for x, y in zip(a, b))
                assert worst <= 2 * LION["lr"] * (step + 1) + 1e-6, f"{name}: step {step}, parameter {n}: {worst}"
                continue
            assert a == b, f"{name}: step {step}, parameter {n}: {sum(x != y for x, y in zip(a, b))} elements differ"
    # each rank's momentum is its node's, its own shard of it
    for rank, r in enumerate(per_rank):
        node, shard = divmod(rank, L)
        for n in names:
            full = torch.tensor(ref["momentum"][node][n]).view(shapes[n])
            want = _chunk(full, shard).flatten()
            if cfg["compile"]:  # from gradients rounded differently (and parameters a flipped vote moved)
                assert torch.allclose(torch.tensor(r["momentum"][n]), want, rtol=0.05, atol=1e-3), (name, rank, n)
                continue
            assert r["momentum"][n] == want.tolist(), (name, rank, n)
    assert run["steps"] == ref["applied"] == cfg["steps"] - (1 if cfg["overflow"] else 0)
    # every step but the first replayed its plan (lionbit.fsdp_plan), where a plan can ("vote", the list kernels)
    plannable = cfg["aggregation"] == "vote" and run["plannable"]
    assert run["replayed"] == (run["steps"] - 1 if plannable else 0), run["replayed"]
    if cfg["clip"]:
        assert ref["norm_rel_err"] < 1e-5, ref["norm_rel_err"]
    if cfg["tie_break"] == "random":
        assert ref["random_ties"] > 0


def test_hsdp_replicas_bitwise_equal_and_momentum_a_shard(runs):
    d = sum(p.numel() for p in _model().parameters())
    for i in range(len(CONFIGS)):
        per_rank = [r["runs"][i] for r in runs]
        for shard in range(L):
            # ranks with the same shard index hold the same local parameters, bitwise
            assert per_rank[shard]["local"] == per_rank[L + shard]["local"]
    for r in runs:
        # a rank's momentum is its share of its node's: 1/L of the 1-D FSDP momentum (d fp32 elements a rank)
        assert r["flat_state_bytes"] == 4 * d
    per_rank = [r["runs"][0]["state_bytes"] for r in runs]
    for rank, got in enumerate(per_rank):
        # exactly FSDP's shard of every parameter (dim 0 split as torch.chunk splits it: 19 + 18 rows of 37)
        assert got == 4 * sum(_chunk(p, rank % L).numel() for p in _model().parameters())
    for node in range(M):
        assert sum(per_rank[node * L : (node + 1) * L]) == 4 * d


def hsdp_probe(rank, world_size) -> bool:
    """For test_torch_internals (the foreach_reduce wrapper): HSDP on a
    world_size x 1 mesh; each replica's p.grad after backward is its own
    gradient, not the replicas' mean, and a step keeps the replicas equal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import lionbit

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(_model(), mesh=mesh)
    plain = _model()
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    _loss(model, rank, 0).backward()
    _loss(plain, rank, 0).backward()
    own = all(torch.equal(p.grad.to_local(), q.grad) for p, q in zip(model.parameters(), plain.parameters()))
    opt.step()
    digest = torch.cat([p.to_local().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(digest) for _ in range(world_size)]
    torch.distributed.all_gather(everyone, digest)
    return own and all(torch.equal(everyone[0], x) for x in everyone)
