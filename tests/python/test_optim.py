"""DistributedLion against a pure numpy reference of the update, on real
processes: plain modules, DDP with every option that matters, checkpoints,
bytes per step."""

import hashlib
import math
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import run_ranks, values

# make test-aten runs the files marked so again through the ATen kernel set.
pytestmark = pytest.mark.kernels

F32 = np.float32


class ReferenceLion:
    """All N ranks of Distributed Lion in numpy float32, one op at a time (no
    fused multiply-add): the contract every lionbit path must equal bitwise."""

    def __init__(self, params, n, lr, betas, wd, aggregation):
        # (a float64 parameter is updated in float64; its direction and momentum are float32's)
        self.x = [p.detach().numpy().astype(np.float64 if p.dtype == torch.float64 else F32).copy() for p in params]
        self.m = [[np.zeros(x.shape, dtype=F32) for x in self.x] for _ in range(n)]
        self.n, self.agg = n, aggregation
        self.b1, self.omb1 = F32(betas[0]), F32(1.0 - betas[0])
        self.b2, self.omb2 = F32(betas[1]), F32(1.0 - betas[1])
        self.lr, self.decay = F32(lr), F32(1.0 - lr * wd)
        self.lr64, self.decay64 = np.float64(lr), np.float64(1.0 - lr * wd)

    def step(self, grads):  # grads[rank][param] as numpy float32
        for i, x in enumerate(self.x):
            total = np.zeros(x.shape, dtype=np.float64)
            for r in range(self.n):
                g, m = grads[r][i], self.m[r][i]
                c = (self.b1 * m) + (self.omb1 * g)
                total += np.sign(c)
                self.m[r][i] = (self.b2 * m) + (self.omb2 * g)
            delta = np.sign(total) if self.agg == "vote" else total / self.n
            delta = delta.astype(F32)
            if x.dtype == np.float64:
                self.x[i] = (x * self.decay64) - (self.lr64 * delta.astype(np.float64))
            else:
                self.x[i] = (x * self.decay) - (self.lr * delta)


def _model(seed=0, unused=False):
    torch.manual_seed(seed)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(12, 32)
            self.b = torch.nn.Linear(32, 32)
            self.head = torch.nn.Linear(32, 3)
            self.frozen = torch.nn.Linear(3, 3)  # does not require grad
            self.frozen.requires_grad_(False)
            self.spare = torch.nn.Linear(32, 3)  # used only on even steps when unused=True

        def forward(self, x, it=0):
            h = torch.tanh(self.b(torch.tanh(self.a(x))))
            out = self.frozen(self.head(h))
            if not unused or it % 2 == 0:
                out = out + self.spare(h)
            return out

    return Net()


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)


def _loss(model, rank, step, micro=0, **kw):
    x, y = _batch(rank, step, micro)
    return torch.nn.functional.cross_entropy(model(x, **kw), y)


def _hash(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _groups(model):
    # Two parameter groups with their own hyperparameters.
    return [
        {"params": list(model.a.parameters()) + list(model.b.parameters()), "lr": 3e-3, "weight_decay": 0.1},
        {"params": list(model.head.parameters()) + list(model.spare.parameters()), "lr": 1e-3, "betas": (0.8, 0.95)},
    ]


def _gathered_grads(model, n):
    """Every rank's gradients of the trainable parameters, as numpy."""
    out = [[] for _ in range(n)]
    for p in [p for p in model.parameters() if p.requires_grad]:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        parts = [torch.empty_like(g) for _ in range(n)]
        dist.all_gather(parts, g.contiguous())
        for r in range(n):
            out[r].append(parts[r].numpy().astype(F32))
    return out


def _references(model, n, aggregation):
    groups = _groups(model)
    refs = []
    for g in groups:
        refs.append(
            ReferenceLion(
                g["params"], n, g["lr"], g.get("betas", (0.9, 0.99)), g.get("weight_decay", 0.0), aggregation
            )
        )
    return groups, refs


def _ref_step(model, refs, groups, grads):
    trainable = [p for p in model.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(trainable)}
    for ref, g in zip(refs, groups):
        ref.step([[grads[r][index[id(p)]] for p in g["params"]] for r in range(len(grads))])


def _assert_equals_reference(refs, groups, where):
    for ref, g in zip(refs, groups):
        for x, p in zip(ref.x, g["params"]):
            assert np.array_equal(x.view(np.int32), p.detach().numpy().view(np.int32)), (
                f"{where}: differs from the reference (max |diff| {np.abs(x - p.detach().numpy()).max()})"
            )


def plain_module_matches_reference(rank, n, aggregation, fused, steps=12):
    import lionbit

    model = _model()
    groups, refs = _references(model, n, aggregation)
    opt = lionbit.DistributedLion(_groups(model), aggregation=aggregation, fused=fused)
    opt.attach(model)  # a plain module: a no-op
    for step in range(steps):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        _ref_step(model, refs, groups, _gathered_grads(model, n))
        opt.step()
        _assert_equals_reference(refs, groups, f"step {step}")
    return _hash(model)


@pytest.mark.parametrize(
    "world_size,aggregation,fused",
    [(1, "vote", True), (3, "vote", True), (4, "avg", True), (2, "vote", False), (3, "avg", False), (1, "vote", False)],
)
def test_plain_module_equals_reference_bitwise(world_size, aggregation, fused):
    # Both implementations - the fused C++ kernels and plain torch ops - equal
    # the numpy reference bit for bit; at N = 1 that is single-process Lion.
    hashes = values(
        run_ranks(
            "test_optim:plain_module_matches_reference", world_size,
            kwargs={"aggregation": aggregation, "fused": fused},
        )
    )
    assert len(set(hashes)) == 1, "replicas differ"


def single_process(rank, n):
    """No process group at all: DistributedLion is single-process Lion."""
    import lionbit

    assert not dist.is_initialized()
    model = _model()
    groups, refs = _references(model, 1, "vote")
    opt = lionbit.DistributedLion(_groups(model))
    for step in range(50):
        opt.zero_grad()
        _loss(model, 0, step).backward()
        grads = [[p.grad.numpy().astype(F32) for p in model.parameters() if p.requires_grad]]
        _ref_step(model, refs, groups, grads)
        opt.step()
    _assert_equals_reference(refs, groups, "single process")
    return True


def test_without_a_process_group_it_is_single_process_lion():
    assert values(run_ranks("test_optim:single_process", 1, backend=None)) == [True]


def refuses_what_it_cannot_step(rank, n):
    """A sparse embedding's gradient, or a parameter on a device other than CPU and CUDA, among a
    model's dense ones: step() names the problem and changes no parameter and no momentum."""
    import lionbit

    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2)
    opt = lionbit.DistributedLion(list(head.parameters()) + list(emb.parameters()), lr=1e-3)
    head(emb(torch.tensor([1, 2]))).sum().backward()
    before = [p.detach().clone() for p in (*head.parameters(), emb.weight)]
    with pytest.raises(RuntimeError, match=r"DistributedLion\.step: sparse gradients are not supported"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, (*head.parameters(), emb.weight))) and not opt.state
    emb.weight.grad = None
    opt.step()  # the dense ones alone step
    assert not torch.equal(before[0], head.weight)

    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    meta.grad = torch.zeros(3, device="meta")
    opt = lionbit.DistributedLion([*head.parameters(), meta], lr=1e-3)
    before = [p.detach().clone() for p in head.parameters()]
    with pytest.raises(RuntimeError, match=r"DistributedLion\.step: parameters on meta are not supported"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, head.parameters())) and not opt.state
    return True


def test_a_step_refuses_sparse_gradients_and_other_devices_changing_nothing():
    assert values(run_ranks("test_optim:refuses_what_it_cannot_step", 1, backend=None)) == [True]


def _ddp_train(rank, n, steps, *, ddp_kwargs, accumulate=1, unused=False, attach=True, aggregation="vote",
               start=0, model=None, opt=None):
    import lionbit

    if model is None:
        model = _model(unused=unused)
    ddp = DDP(model, bucket_cap_mb=0.01, **ddp_kwargs)  # several buckets
    if opt is None:
        opt = lionbit.DistributedLion(_groups(model), aggregation=aggregation)
    if attach:
        opt.attach(ddp)
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(accumulate):
            if micro < accumulate - 1:
                with ddp.no_sync():
                    _loss(ddp, rank, step, micro, it=step).backward()
            else:
                _loss(ddp, rank, step, micro, it=step).backward()
        opt.step()
    return model, opt


def _plain_train(rank, n, steps, accumulate=1, unused=False, aggregation="vote"):
    import lionbit

    model = _model(unused=unused)
    opt = lionbit.DistributedLion(_groups(model), aggregation=aggregation)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            _loss(model, rank, step, micro, it=step).backward()
        if unused:
            # What DDP hands a rank for a parameter no rank used: nothing.
            for p in model.spare.parameters():
                if step % 2 == 1:
                    p.grad = None
        opt.step()
    return model


DDP_CASES = {
    "default": dict(ddp_kwargs={}),
    "bucket_view": dict(ddp_kwargs={"gradient_as_bucket_view": True}),
    "static_graph": dict(ddp_kwargs={"static_graph": True}),
    "no_sync": dict(ddp_kwargs={}, accumulate=3),
    "avg": dict(ddp_kwargs={}, aggregation="avg"),
}


def ddp_equals_plain_module(rank, n, case):
    kw = DDP_CASES[case]
    model, _ = _ddp_train(rank, n, 10, **kw)
    plain = _plain_train(rank, n, 10, accumulate=kw.get("accumulate", 1), aggregation=kw.get("aggregation", "vote"))
    assert _hash(model) == _hash(plain), f"{case}: DDP + attach differs from the plain-module step"
    return _hash(model)


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_attach_equals_plain_module_and_replicas_match(case):
    hashes = values(run_ranks("test_optim:ddp_equals_plain_module", 3, kwargs={"case": case}))
    assert len(set(hashes)) == 1, "replicas differ"


def ddp_unused_parameters(rank, n):
    # A parameter used on every other step only: find_unused_parameters.
    model, _ = _ddp_train(rank, n, 60, ddp_kwargs={"find_unused_parameters": True}, unused=True)
    return _hash(model)


def test_ddp_find_unused_parameters_keeps_replicas_identical():
    hashes = values(run_ranks("test_optim:ddp_unused_parameters", 2))
    assert len(set(hashes)) == 1


def ddp_bytes_per_step(rank, n):
    import lionbit

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 10)
    )
    d = sum(p.numel() for p in model.parameters())
    ddp = DDP(model)  # default buckets (25 MB, 1 MB first)
    opt = lionbit.DistributedLion(model.parameters(), lr=1e-4).attach(ddp)

    def one_step(step):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(16, 256, generator=g), torch.randint(0, 10, (16,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    one_step(0)  # DDP builds its buckets in the first step
    lionbit.reset_stats()
    steps = 5
    for step in range(1, 1 + steps):
        one_step(step)
    s = lionbit.stats()
    return {"d": d, "bytes_per_step": s["bytes_sent"] / steps, "calls": s["sign_allreduce_calls"]}


def test_ddp_bytes_per_step_are_the_one_bit_figure():
    n = 3  # odd N: a vote of zero-free directions never ties
    res = values(run_ranks("test_optim:ddp_bytes_per_step", n))
    for r in res:
        one_bit = 2 * (n - 1) / n * r["d"] / 8
        fp32 = 2 * (n - 1) / n * 4 * r["d"]
        assert r["bytes_per_step"] <= one_bit * 1.05, r
        assert fp32 / r["bytes_per_step"] > 30, r


def checkpoint_resume(rank, n, ckpt_dir):
    import lionbit

    path = os.path.join(ckpt_dir, f"rank{rank}.pt")
    # Uninterrupted: 12 steps.
    full, _ = _ddp_train(rank, n, 12, ddp_kwargs={})
    # Interrupted: 6 steps, save (each rank its own momentum), then a new
    # model and optimizer load it and run 6 more.
    model, opt = _ddp_train(rank, n, 6, ddp_kwargs={})
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    dist.barrier()
    fresh = _model(seed=123)  # different initial values: all must come from the file
    fresh_opt = lionbit.DistributedLion(_groups(fresh))
    ckpt = torch.load(path)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["optimizer"])
    resumed, _ = _ddp_train(rank, n, 6, ddp_kwargs={}, start=6, model=fresh, opt=fresh_opt)
    assert _hash(resumed) == _hash(full), "resumed run differs from the uninterrupted one"
    return _hash(full)


def test_checkpoint_stop_restart_continue_is_bitwise_identical():
    with tempfile.TemporaryDirectory() as d:
        hashes = values(run_ranks("test_optim:checkpoint_resume", 2, kwargs={"ckpt_dir": d}))
    assert len(set(hashes)) == 1


def rank_file_elsewhere(rank, n, ckpt_dir):
    """A job back on another number of ranks, each rank loading the file of
    its own number (the last file where there is none): what it is told."""
    import warnings

    import lionbit

    opt = lionbit.DistributedLion(_groups(_model(seed=123)))
    ckpt = torch.load(os.path.join(ckpt_dir, f"rank{min(rank, 1)}.pt"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(ckpt["optimizer"])
    return [str(w.message) for w in caught if "DistributedLion.load_state_dict" in str(w.message)]


def test_a_rank_file_on_another_number_of_ranks_says_whose_it_is():
    with tempfile.TemporaryDirectory() as d:
        run_ranks("test_optim:checkpoint_resume", 2, kwargs={"ckpt_dir": d})
        said = {n: values(run_ranks("test_optim:rank_file_elsewhere", n, kwargs={"ckpt_dir": d})) for n in (1, 3)}
    for n, rank in ((1, 0), (3, 0), (3, 1)):
        assert len(said[n][rank]) == 1 and (f"on rank {rank}: this state dict holds this rank's own momentum, saved "
                                            f"by a run of 2 ranks, and this run has {n}: this rank continues from "
                                            f"it") in said[n][rank][0], said[n][rank]
    assert len(said[3][2]) == 1 and ("on rank 2: this state dict holds the momentum of rank 1 of 2, so this rank "
                                     "continues from that rank's momentum, not its own") in said[3][2][0], said[3][2]


def rank0_file_before_the_first_step(rank, n, ckpt_dir):
    """Rank 0 saves the optimizer before any step and every rank restores it
    (Lightning's LR finder does): no momenta, so no rank's; what is said."""
    import warnings

    import lionbit

    model = _model(seed=1)
    opt = lionbit.DistributedLion(_groups(model))
    if rank == 0:
        torch.save(opt.state_dict(), os.path.join(ckpt_dir, "before.pt"))
    dist.barrier()
    _ddp_train(rank, n, 2, ddp_kwargs={}, model=model, opt=opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(torch.load(os.path.join(ckpt_dir, "before.pt")))
    return {"said": [str(w.message) for w in caught], "momenta": len(opt.state)}


def test_a_file_saved_before_the_first_step_is_no_ranks():
    with tempfile.TemporaryDirectory() as d:
        res = values(run_ranks("test_optim:rank0_file_before_the_first_step", 2, kwargs={"ckpt_dir": d}))
    assert res == [{"said": [], "momenta": 0}] * 2, res


class _AppState:
    """A Stateful app state as a framework's checkpoint manager makes one:
    its state_dict reaches the optimizer's through 20 nested calls."""

    def __init__(self, model, opt, depth=20):
        self.model, self.opt, self.depth = model, opt, depth

    def _nested(self, fn, depth):
        return fn() if depth == 0 else self._nested(fn, depth - 1)

    def state_dict(self):
        return self._nested(lambda: {"model": self.model.state_dict(), "optim": self.opt.state_dict()}, self.depth)

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])


def dcp_resume(rank, n, ckpt_dir, how):
    """torch.distributed.checkpoint, as PyTorch's guide to it writes the
    loop: 12 uninterrupted steps against 6, a save, a fresh model and
    optimizer (another seed) loading it, 6 more. ``how``: "get/set" (get_state_dict /
    set_state_dict, as docs/checkpoints.md writes it) or
    "stateful" (dcp.save / dcp.load of the optimizer object itself). DCP
    keeps one value per entry (a plain tensor: one rank's copy), so each
    momentum goes as an (N, *shape) DTensor, row r rank r's: every rank must
    resume its own momentum, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import lionbit

    full, full_opt = _ddp_train(rank, n, 12, ddp_kwargs={})
    model, opt = _ddp_train(rank, n, 6, ddp_kwargs={})
    path = os.path.join(ckpt_dir, how)
    if how == "get/set":
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    elif how == "app state":
        dcp.save({"app": _AppState(model, opt)}, checkpoint_id=path)
    else:
        dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=path)
    fresh = _model(seed=123)
    fresh_opt = lionbit.DistributedLion(_groups(fresh))
    if how == "get/set":
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(fresh, fresh_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    elif how == "app state":
        dcp.load({"app": _AppState(fresh, fresh_opt)}, checkpoint_id=path)
    else:
        sd = {"model": fresh.state_dict(), "optim": fresh_opt}
        dcp.load(sd, checkpoint_id=path)
        fresh.load_state_dict(sd["model"])
    own = all(torch.equal(fresh_opt.state[a]["exp_avg"], opt.state[b]["exp_avg"])
              for a, b in zip(fresh.parameters(), model.parameters()) if b in opt.state)
    resumed, _ = _ddp_train(rank, n, 6, ddp_kwargs={}, start=6, model=fresh, opt=fresh_opt)
    return {"own": own, "bitwise": _hash(resumed) == _hash(full), "steps": fresh_opt.steps_taken,
            "momentum": _hash_momenta(fresh_opt, resumed)}


def _hash_momenta(opt, model):
    h = hashlib.sha256()
    for p in model.parameters():
        if p in opt.state:
            h.update(opt.state[p]["exp_avg"].float().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("how", ["get/set", "stateful", "app state"])
def test_dcp_resume_gives_every_rank_its_own_momentum(how):
    with tempfile.TemporaryDirectory() as d:
        res = values(run_ranks("test_optim:dcp_resume", 2, kwargs={"ckpt_dir": d, "how": how}))
    for r in res:
        assert r["own"] and r["bitwise"], r
        assert r["steps"] == 12, r
    assert res[0]["momentum"] != res[1]["momentum"]  # each rank's own, not one rank's for all


def dcp_made_beforehand(rank, n, ckpt_dir):
    """A script that hands DCP a state dict it made itself,
    ``dcp.save({"model": ..., "optim": opt.state_dict()})``, and later rolls
    back to it (a loss spike) the same way: DCP keeps one rank's copy of each
    plain momentum, so the momenta that come back mix the ranks'. Every rank
    must say so, counting the momenta that are not those of the rank whose
    record the dict holds; a file a rank loads on its own rank silently."""
    import warnings

    import torch.distributed.checkpoint as dcp

    model, opt = _ddp_train(rank, n, 6, ddp_kwargs={})
    params = [p for p in model.parameters() if "exp_avg" in opt.state.get(p, {})]
    saved = [opt.state[p]["exp_avg"].clone() for p in params]
    every = [[torch.empty_like(m) for _ in range(n)] for m in saved]  # each rank's, to tell whose comes back
    for out, m in zip(every, saved):
        dist.all_gather(out, m)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=os.path.join(ckpt_dir, "dcp"))
    torch.save(opt.state_dict(), os.path.join(ckpt_dir, f"rank{rank}.pt"))
    model, opt = _ddp_train(rank, n, 2, ddp_kwargs={}, start=6, model=model, opt=opt)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=os.path.join(ckpt_dir, "dcp"))
    model.load_state_dict(sd["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(sd["optim"])
    said = [str(w.message) for w in caught if "DistributedLion" in str(w.message)]
    whose = [[r for r in range(n) if torch.equal(opt.state[p]["exp_avg"], every[i][r])] for i, p in enumerate(params)]
    with warnings.catch_warnings(record=True) as own_file:
        warnings.simplefilter("always")
        opt.load_state_dict(torch.load(os.path.join(ckpt_dir, f"rank{rank}.pt")))
    own = all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(params, saved))
    # the restart: a new process's fresh model and optimizer, the dict made the same way before dcp.load
    model, opt = _ddp_train(rank, n, 0, ddp_kwargs={}, model=_model(seed=123))
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    with warnings.catch_warnings(record=True) as fresh:
        warnings.simplefilter("always")
        dcp.load(sd, checkpoint_id=os.path.join(ckpt_dir, "dcp"))
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    fresh_said = [str(w.message) for w in fresh if "DistributedLion" in str(w.message)]
    fresh_momenta = len(opt.state)
    # the rollback into an optimizer of another momentum_dtype: DCP casts into its bfloat16 momenta, whose
    # checksums the record's cannot meet: whose they are is not told (rank 0 was told "rank 1's", falsely)
    import lionbit

    model = _model(seed=123)
    model, opt = _ddp_train(rank, n, 2, ddp_kwargs={}, model=model,
                            opt=lionbit.DistributedLion(_groups(model), momentum_dtype=torch.bfloat16))
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    with warnings.catch_warnings(record=True) as cast:
        warnings.simplefilter("always")
        dcp.load(sd, checkpoint_id=os.path.join(ckpt_dir, "dcp"))
        opt.load_state_dict(sd["optim"])
    return {"said": said, "whose": whose, "own_file_said": [str(w.message) for w in own_file], "own": own,
            "fresh_said": fresh_said, "fresh_momenta": fresh_momenta, "recorded": len(params),
            "cast_said": [str(w.message) for w in cast if "DistributedLion" in str(w.message)]}


def test_a_state_dict_dcp_mixed_says_so_on_every_rank():
    import re

    with tempfile.TemporaryDirectory() as d:
        res = values(run_ranks("test_optim:dcp_made_beforehand", 2, kwargs={"ckpt_dir": d}))
    whose = res[0]["whose"]
    assert all(r["whose"] == whose for r in res) and all(len(w) == 1 for w in whose), res  # one rank's copy each
    assert len({w[0] for w in whose}) == 2, whose  # DCP balances the ranks' writes: both ranks' momenta came back
    for rank, r in enumerate(res):
        assert len(r["said"]) == 1, r
        found = re.search(r"on rank (\d): (\d+) of the (\d+) momenta in this state dict are not rank (\d)'s",
                          r["said"][0])
        assert found and int(found[1]) == rank, r["said"]
        origin = int(found[4])
        assert int(found[2]) == sum(w[0] != origin for w in whose) and int(found[3]) == len(whose), (r["said"], whose)
        assert "dcp.save({'optim': opt})" in r["said"][0], r["said"]
        assert r["own"] and r["own_file_said"] == [], r  # a file a rank, on its rank: exact and silent
        # a fresh optimizer's dict: no entries for DCP to fill, said (it was DCP's size error on the record)
        assert r["fresh_momenta"] == 0 and len(r["fresh_said"]) == 1, r
        assert f"on rank {rank}: this state dict lacks {r['recorded']} of the momenta its record lists" \
            in r["fresh_said"][0], r["fresh_said"]
        assert r["cast_said"] == [], r["cast_said"]


def dcp_at_step_zero(rank, n, ckpt_dir, wrap):
    """A checkpoint before the first step (a seed checkpoint, or a loop that
    saves every k steps from step 0) through get_state_dict / dcp.save, with a
    momentum synchronization every 2 steps. torch fills a fresh optimizer's
    state by a step() on zero gradients with lr 0: that must create zero
    momentum and nothing else (no step counted, no collective, no
    synchronization), so the 4 steps after it equal a run without the save,
    parameters and this rank's momentum, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import lionbit

    def train(save):
        model = _model()
        net = DDP(model, bucket_cap_mb=0.01) if wrap == "ddp" else model
        opt = lionbit.DistributedLion(_groups(model), momentum_sync=2)
        opt.attach(net)
        out = {}
        if save:
            lionbit.reset_stats()
            model_sd, optim_sd = get_state_dict(net, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(ckpt_dir, wrap))
            st = lionbit.stats()
            out = {"steps": opt.steps_taken, "group_steps": [g["step"] for g in opt.param_groups],
                   "calls": st["sign_allreduce_calls"], "synced": st["momentum_sync_calls"],
                   "zeros": sorted({bool(opt.state[p]["exp_avg"].any()) if p in opt.state else None
                                    for p in model.parameters() if p.requires_grad}),
                   "grads": sorted({p.grad is None for p in model.parameters()})}
        for step in range(4):
            opt.zero_grad()
            _loss(net, rank, step, 0, it=step).backward()
            opt.step()
        out["params"] = _hash(model)
        out["momentum"] = _hash_momenta(opt, model)
        out["steps_after"] = opt.steps_taken
        return out

    return {"plain": train(False), "saved": train(True)}


@pytest.mark.parametrize("wrap", ["ddp", "plain"])
def test_a_checkpoint_before_the_first_step_is_not_a_step(wrap):
    with tempfile.TemporaryDirectory() as d:
        res = values(run_ranks("test_optim:dcp_at_step_zero", 2, kwargs={"ckpt_dir": d, "wrap": wrap}))
    for r in res:
        saved = r["saved"]
        assert (saved["steps"], saved["group_steps"], saved["calls"], saved["synced"]) == (0, [0, 0], 0, 0), saved
        assert saved["zeros"] == [False] and saved["grads"] == [True], saved
        assert (saved["params"], saved["momentum"]) == (r["plain"]["params"], r["plain"]["momentum"])
        assert saved["steps_after"] == r["plain"]["steps_after"] == 4


def test_one_process_loads_a_consolidated_file_of_three_ranks_as_their_mean():
    """A single-process run (no process group) given a consolidated file's
    momenta, every rank's stacked (get_optimizer_state_dict with
    full_state_dict=True): three ranks' start it from their mean (float64
    here, to float32's rounding), with a warning; one rank's, from its row."""
    import lionbit

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    rows = {i: torch.randn(3, *p.shape) for i, p in enumerate(model.parameters())}
    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.0, "params": [0, 1]}]
    opt = lionbit.DistributedLion(model.parameters(), lr=0.5)
    with pytest.warns(UserWarning, match="holds the momenta of 3 workers and this run has 1"):
        opt.load_state_dict({"state": {i: {"exp_avg": r} for i, r in rows.items()}, "param_groups": groups})
    for i, p in enumerate(model.parameters()):
        mean = rows[i].double().mean(0)
        assert (opt.state[p]["exp_avg"].double() - mean).abs().max() <= 2 ** -22 * rows[i].abs().max()
    assert opt.param_groups[0]["lr"] == 0.1
    opt.load_state_dict({"state": {i: {"exp_avg": r[1:2]} for i, r in rows.items()}, "param_groups": groups})
    assert all(torch.equal(opt.state[p]["exp_avg"], rows[i][1]) for i, p in enumerate(model.parameters()))


def test_a_bfloat16_models_float32_momentum_survives_its_state_dict():
    """torch's load_state_dict casts the state to each parameter's dtype; a
    bfloat16 model's momentum (float32 by default) comes back as it was saved,
    not rounded to bfloat16, and the steps after it are the uninterrupted ones."""
    import copy

    import lionbit

    def run(steps, resume_at=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(torch.bfloat16)
        opt = lionbit.DistributedLion(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        for step in range(steps):
            if step == resume_at:
                sd = copy.deepcopy(opt.state_dict())
                saved = {p: opt.state[p]["exp_avg"].clone() for p in model.parameters()}
                opt = lionbit.DistributedLion(model.parameters(), lr=1e-2)
                opt.load_state_dict(sd)
                for p in model.parameters():
                    m = opt.state[p]["exp_avg"]
                    assert m.dtype == torch.float32 and torch.equal(m, saved[p])
                    assert not torch.equal(m, m.to(torch.bfloat16).float())  # one that bfloat16 cannot hold
            opt.zero_grad()
            model(torch.randn(2, 8, generator=gen).to(torch.bfloat16)).float().square().sum().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(6), run(6, resume_at=3)):
        assert torch.equal(a, b)


def bad_arguments(rank, n):
    import lionbit

    model = _model()
    for kwargs, match in [
        ({"lr": -1.0}, "'lr'"),
        ({"betas": (1.0, 0.9)}, "'betas'"),
        ({"weight_decay": -0.1}, "'weight_decay'"),
        ({"aggregation": "median"}, "'aggregation'"),
        ({"momentum_dtype": torch.float16}, "'momentum_dtype'"),
    ]:
        with pytest.raises(ValueError, match=match):
            lionbit.DistributedLion(model.parameters(), **kwargs)
    # A DDP model whose parameters the optimizer does not hold.
    ddp = DDP(model)
    opt = lionbit.DistributedLion(model.head.parameters())
    with pytest.raises(ValueError, match="not in this optimizer"):
        opt.attach(ddp)
    # NaN / Inf gradients: an error on every rank, naming the rank, before
    # any parameter or momentum changed anywhere.
    opt = lionbit.DistributedLion(model.parameters())
    _loss(model, rank, 0).backward()
    opt.step()
    for bad in (float("nan"), float("inf"), float("-inf")):
        opt.zero_grad()
        _loss(model, rank, 1).backward()
        if rank == 1:
            model.a.weight.grad[0, 0] = bad
        before = [p.detach().clone() for p in model.parameters()]
        momenta = {p: s["exp_avg"].clone() for p, s in opt.state.items()}
        assert momenta
        with pytest.raises(RuntimeError, match=r"non-finite gradient \(inf or NaN\) on rank\(s\) \[1\]"):
            opt.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert all(torch.equal(m, opt.state[p]["exp_avg"]) for p, m in momenta.items())
    return True


def test_bad_arguments_and_nan_gradients():
    assert all(values(run_ranks("test_optim:bad_arguments", 2)))


def bf16_momentum(rank, n):
    import lionbit

    model = _model()
    opt = lionbit.DistributedLion(model.parameters(), lr=1e-3, momentum_dtype=torch.bfloat16)
    for step in range(3):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
    m = opt.state[model.a.weight]["exp_avg"]
    assert m.dtype == torch.bfloat16
    sd = opt.state_dict()
    opt2 = lionbit.DistributedLion(model.parameters(), lr=1e-3, momentum_dtype=torch.bfloat16)
    opt2.load_state_dict(sd)
    assert opt2.state[model.a.weight]["exp_avg"].dtype == torch.bfloat16
    return _hash(model)


def test_bfloat16_momentum():
    hashes = values(run_ranks("test_optim:bf16_momentum", 2))
    assert len(set(hashes)) == 1


def mixed_dtypes_match_reference(rank, n, steps=6):
    """A float32 layer, then a float64 one: the step asks the fused kernels
    once per kind of pair, so the float32 pairs take them and the float64
    pairs (no fused kernel) the torch path, which computes their directions
    and momenta in float32 too and their update in float64 (in float32 it
    would round each parameter to float32 every step)."""
    import lionbit

    torch.manual_seed(0)
    a, b = torch.nn.Linear(12, 16), torch.nn.Linear(16, 3).double()
    params = list(a.parameters()) + list(b.parameters())
    ref = ReferenceLion(params, n, 1e-3, (0.9, 0.99), 0.1, "vote")
    opt = lionbit.DistributedLion(params, lr=1e-3, weight_decay=0.1)
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(rank, step)
        torch.nn.functional.cross_entropy(b(torch.tanh(a(x)).double()).float(), y).backward()
        grads = [[] for _ in range(n)]
        for p in params:
            parts = [torch.empty_like(p.grad) for _ in range(n)]
            dist.all_gather(parts, p.grad)
            for r in range(n):
                grads[r].append(parts[r].numpy().astype(F32))
        ref.step(grads)
        opt.step()
    for x, p in zip(ref.x, params):
        assert p.dtype in (torch.float32, torch.float64)
        bits = np.int64 if x.dtype == np.float64 else np.int32
        assert x.dtype == p.detach().numpy().dtype, p.dtype
        assert np.array_equal(x.view(bits), p.detach().numpy().view(bits)), p.dtype
        if p.dtype == torch.float64:  # not float32 values stored in float64
            assert not np.array_equal(x, x.astype(F32).astype(np.float64)), "float64 parameter rounded to float32"
    return _hash(a) + _hash(b)


def test_a_step_of_two_dtypes_equals_the_reference():
    assert len(set(values(run_ranks("test_optim:mixed_dtypes_match_reference", 2)))) == 1


def test_a_gpu_step_votes_a_many_tensor_model_in_few_calls():
    """Each vote has fixed costs (on a GPU about 130 kernel launches and some host round trips): a
    GPT-2-medium-shaped model's 292 tensors go in 2 votes on a GPU, in the CPU's 4M-element votes
    elsewhere; every tensor in exactly one vote, in order."""
    from lionbit import step_vote

    w = 1024
    shapes = [(50257, w), (1024, w)]
    for _ in range(24):
        shapes += [(w,), (w,), (3 * w, w), (3 * w,), (w, w), (w,), (w,), (w,), (4 * w, w), (4 * w,), (w, 4 * w), (w,)]
    shapes += [(w,), (w,)]
    sizes = [math.prod(s) for s in shapes]
    for device, calls in (("cuda", 2), ("cpu", 123)):
        chunks = step_vote.chunking(sizes, step_vote.chunk_limit(device))
        assert len(chunks) == calls, (device, len(chunks))
        assert [c[0] for c in chunks] == [0] + [c[1] for c in chunks[:-1]] and chunks[-1][1] == len(sizes)
        assert all(total == sum(sizes[a:b]) for a, b, total in chunks)
        assert all(total <= step_vote.chunk_limit(device) or b - a == 1 for a, b, total in chunks)
