"""DistributedLion on FSDP2 (fully_shard) models and the sign reduce-scatter,
on real processes: parity with DDP + DistributedLion, bytes per step,
gradient accumulation, FSDP2's knobs (resharding, prefetching, unshard(), a
tied embedding), mixed precision, DCP checkpoints, plain FSDP over lionbit,
errors."""

import contextlib
import hashlib
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values

# make test-aten runs the files marked so again through the ATen kernel set.
pytestmark = pytest.mark.kernels


class Net(torch.nn.Module):
    """Sizes chosen so that FSDP pads: dim 0 of 33, 7 and 3 rows are not
    multiples of 2, 3 or 4, and the head has fewer rows than 4 ranks."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 33)
        self.b = torch.nn.Linear(33, 7)
        self.head = torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _net(seed=0):
    torch.manual_seed(seed)
    return Net()


def _batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)


def _loss(model, rank, step, micro=0):
    device = next(model.parameters()).device  # the same batch on the model's device
    x, y = (t.to(device) for t in _batch(rank, step, micro))
    return torch.nn.functional.cross_entropy(model(x), y)


def _digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()


def _full_params(model):
    out = []
    for p in model.parameters():
        out.append(p.full_tensor() if hasattr(p, "full_tensor") else p.detach())
    return out


def _shard(model, nested=True, device=None, **kw):
    from torch.distributed.fsdp import fully_shard

    if device is not None:  # a 1-D mesh of that device type (default: torch's, CUDA where there is one)
        from torch.distributed.device_mesh import init_device_mesh

        model = model.to(device)
        kw["mesh"] = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    if nested:
        fully_shard(model.a, **kw)
        fully_shard(model.b, **kw)
    fully_shard(model, **kw)
    return model


LION = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)


def _agg(aggregation: str) -> dict:
    """DistributedLion's aggregation arguments from "vote", "avg",
    "vote+alternate" or "l1:4+alternate" (bits after the colon, tie rule
    after the plus), and a hierarchy after an at sign ("vote@node")."""
    aggregation, _, hierarchy = aggregation.partition("@")
    name, _, tie = aggregation.partition("+")
    name, _, bits = name.partition(":")
    kw = {"aggregation": name}
    if bits:
        kw["bits"] = int(bits)
    if tie:
        kw["tie_break"] = tie
    if hierarchy:
        kw["hierarchy"] = hierarchy
    return kw


def _train_ddp(rank, steps, accumulate, aggregation, momentum_dtype=None, device=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    model = DDP(_net().to(device or "cpu"))
    opt = lionbit.DistributedLion(model.parameters(), **_agg(aggregation), momentum_dtype=momentum_dtype, **LION)
    opt.attach(model)
    for step in range(steps):
        for micro in range(accumulate):
            if micro < accumulate - 1:
                with model.no_sync():
                    _loss(model, rank, step, micro).backward()
            else:
                _loss(model, rank, step, micro).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.module.parameters()]


def _train_fsdp(rank, steps, accumulate, aggregation, nested=True, momentum_dtype=None, mp=None, fixed_batch=False,
                device=None, double_buffer=False):
    import lionbit

    kw = {}
    if mp is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp)
    model = _shard(_net(), nested, device=device, **kw)
    opt = lionbit.DistributedLion(model.parameters(), **_agg(aggregation), momentum_dtype=momentum_dtype,
                                  double_buffer=double_buffer, **LION)
    opt.attach(model)
    losses = []
    for step in range(steps):
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)
            loss = _loss(model, rank, 0 if fixed_batch else step, micro)
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return model, opt, losses


def fsdp_vs_ddp(rank, world_size, steps, accumulate, aggregation, momentum_dtype=None, double_buffer=False):
    md = getattr(torch, momentum_dtype) if momentum_dtype else None
    ddp = _train_ddp(rank, steps, accumulate, aggregation, md)
    model, _, _ = _train_fsdp(rank, steps, accumulate, aggregation, momentum_dtype=md, double_buffer=double_buffer)
    full = _full_params(model)
    same = [bool(torch.equal(a, b)) for a, b in zip(ddp, full)]
    moved = float(sum((a - _net().state_dict()[k]).abs().sum() for a, k in zip(full, _net().state_dict())))
    return {"same": same, "digest": _digest(full), "moved": moved}


@pytest.mark.parametrize(
    "world_size,accumulate,aggregation,momentum_dtype",
    [
        (1, 2, "vote", None),
        (2, 1, "vote", None),
        (3, 2, "avg", None),
        (4, 1, "vote", "bfloat16"),
        (4, 1, "vote+alternate", None),
        (3, 1, "l1:4+alternate", None),
        (2, 2, "l1:8", None),
    ],
)
def test_fsdp2_equals_ddp_bitwise(world_size, accumulate, aggregation, momentum_dtype):
    res = values(
        run_ranks(
            "test_fsdp:fsdp_vs_ddp",
            world_size,
            kwargs=dict(steps=12, accumulate=accumulate, aggregation=aggregation, momentum_dtype=momentum_dtype),
        )
    )
    for r in res:
        assert all(r["same"]), r["same"]
        assert r["moved"] > 0.1  # the parameters did change
    assert len({r["digest"] for r in res}) == 1


def accumulate_like_ddp(rank, world_size, habit, steps=4):
    """Gradients accumulate across backward calls as under DDP: two
    synchronized backwards before a step ("two_syncs"), no zero_grad at all
    ("keep"), zero_grad(set_to_none=False) ("zeros"). p.grad (its local
    tensor) equals DDP's before every step; the parameters stay bitwise
    DDP's."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    ddp = DDP(_net())
    dopt = lionbit.DistributedLion(ddp.parameters(), **LION).attach(ddp)
    model = _shard(_net())
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    same_grads = []
    for step in range(steps):
        for k in range(2 if habit == "two_syncs" else 1):
            _loss(ddp, rank, step, k).backward()
            _loss(model, rank, step, k).backward()
        same_grads.append(all(torch.equal(p.grad.to_local(), q.grad)
                              for p, q in zip(model.parameters(), ddp.module.parameters())))
        dopt.step()
        opt.step()
        if habit != "keep":
            dopt.zero_grad(set_to_none=habit == "two_syncs")
            opt.zero_grad(set_to_none=habit == "two_syncs")
    same = [bool(torch.equal(a, b.detach())) for a, b in zip(_full_params(model), ddp.module.parameters())]
    return {"grads": same_grads, "params": same, "digest": _digest(_full_params(model))}


@pytest.mark.parametrize("habit", ["two_syncs", "keep", "zeros"])
def test_fsdp2_gradients_accumulate_like_ddp(habit):
    res = values(run_ranks("test_fsdp:accumulate_like_ddp", 3, kwargs=dict(habit=habit)))
    for r in res:
        assert all(r["grads"]) and all(r["params"]), r
    assert len({r["digest"] for r in res}) == 1


KNOBS = ["reshard_after_forward_false", "reshard_after_forward_int", "explicit_prefetch", "explicit_unshard",
         "no_reshard_after_backward", "is_last_backward", "tied_embedding", "gradient_divide_factor",
         "force_sum_reduction", "eval_before_step"]


class _TiedLM(torch.nn.Module):
    """An embedding and an output head sharing one weight (GPT-2, Llama's small sizes)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(13, 12)
        self.a = torch.nn.Linear(12, 12)
        self.b = torch.nn.Linear(12, 12)
        self.head = torch.nn.Linear(12, 13, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(self.emb(x))))))


def _knob_batch(model, knob, rank, step, micro):
    if knob != "tied_embedding":
        return _loss(model, rank, step, micro)
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    x, y = torch.randint(0, 13, (4, 5), generator=g), torch.randint(0, 13, (4, 5), generator=g)
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def knobs_like_ddp(rank, world_size, knob, steps=5):
    """FSDP2's knobs as torchtitan's and other users' scripts set them, each
    against the same script under DDP: the parameters stay bitwise DDP's."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    def net():
        if knob == "tied_embedding":
            torch.manual_seed(0)
            return _TiedLM()
        return _net()

    accumulate = 2 if knob in ("no_reshard_after_backward", "is_last_backward") else 1
    ddp = DDP(net())
    dopt = lionbit.DistributedLion(ddp.parameters(), **LION).attach(ddp)
    model = net()
    kw = {"reshard_after_forward_false": {"reshard_after_forward": False},
          "reshard_after_forward_int": {"reshard_after_forward": 1},
          "eval_before_step": {"reshard_after_forward": False}}.get(knob, {})
    fully_shard(model.a, **kw)
    fully_shard(model.b, **kw)
    fully_shard(model, **kw)  # (tied: the shared weight in the root's unit)
    for unit in (model.a, model.b, model):
        if knob == "gradient_divide_factor":  # torchtitan's disable_fsdp_gradient_division (a global-token loss)
            unit.set_gradient_divide_factor(1.0)
        elif knob == "force_sum_reduction":  # torchtitan's symmetric-memory setting, without symmetric memory
            unit.set_force_sum_reduction_for_comms(True)
    if knob == "explicit_prefetch":
        model.a.set_modules_to_forward_prefetch([model.b])
        model.b.set_modules_to_backward_prefetch([model.a])
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    for step in range(steps):
        if knob == "explicit_unshard":
            model.unshard()
        for micro in range(accumulate):
            last = micro == accumulate - 1
            if knob == "no_reshard_after_backward":
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
            elif knob == "is_last_backward":
                model.set_requires_gradient_sync(last)
                model.set_is_last_backward(last)
            _knob_batch(model, knob, rank, step, micro).backward()
            if last:
                _knob_batch(ddp, knob, rank, step, micro).backward()
            else:
                with ddp.no_sync():
                    _knob_batch(ddp, knob, rank, step, micro).backward()
        if knob == "eval_before_step":  # docs/fsdp.md: an eval forward between backward() and step(), then
            with torch.no_grad():  # every unit resharded (the root's reshard() alone leaves a and b unsharded)
                _knob_batch(model, knob, rank, step, 0)
            for unit in (model.a, model.b, model):
                unit.reshard()
        opt.step()
        dopt.step()
        opt.zero_grad()
        dopt.zero_grad()
    full = _full_params(model)
    return {"same": [bool(torch.equal(a, b.detach())) for a, b in zip(full, ddp.module.parameters())],
            "digest": _digest(full)}


@pytest.mark.parametrize("knob", KNOBS)
def test_fsdp2_knobs_step_like_ddp(knob):
    res = values(run_ranks("test_fsdp:knobs_like_ddp", 3, kwargs=dict(knob=knob)))
    for r in res:
        assert r["same"] and all(r["same"]), r
    assert len({r["digest"] for r in res}) == 1


def step_cases(rank, world_size):
    """What step() does with the gradients as they stand: a NaN on rank 1
    only (every rank raises naming it, nothing changed anywhere), a p.grad
    set to None (that parameter is not stepped: no update, no decay, its
    momentum kept), a p.grad replaced by a sharded gradient (a clear error);
    training goes on after each."""
    import lionbit

    model = _shard(_net())
    opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
    params = list(model.parameters())

    def state():
        return _digest([p.to_local() for p in params] + [opt.state[p]["exp_avg"] for p in params])

    def step_error():
        try:
            opt.step()
        except RuntimeError as err:
            return str(err)
        return "no error"

    _loss(model, rank, 0).backward()
    opt.step()
    opt.zero_grad()
    out = {}
    before = state()
    _loss(model, rank, 1).backward()
    if rank == 1:
        model.b.weight.grad.to_local()[0, 0] = float("nan")
    out["nan"] = step_error()
    out["nan_changed_nothing"] = state() == before
    opt.zero_grad()

    _loss(model, rank, 2).backward()
    w = model.head.weight
    kept = [w.to_local().clone(), opt.state[w]["exp_avg"].clone(), model.a.weight.to_local().clone()]
    w.grad = None
    opt.step()
    opt.zero_grad()
    out["none_kept"] = torch.equal(w.to_local(), kept[0]) and torch.equal(opt.state[w]["exp_avg"], kept[1])
    out["others_moved"] = not torch.equal(model.a.weight.to_local(), kept[2])

    _loss(model, rank, 3).backward()
    model.a.weight.grad = torch.zeros_like(model.a.weight)  # a Shard(0) DTensor
    out["sharded"] = step_error()
    opt.zero_grad()
    _loss(model, rank, 4).backward()
    opt.step()
    out["steps"] = opt.steps_taken
    out["digest"] = _digest(_full_params(model))
    return out


def test_fsdp2_step_takes_the_gradients_as_they_stand():
    res = values(run_ranks("test_fsdp:step_cases", 3))
    for r in res:
        assert "non-finite gradient (inf or NaN) on rank(s) [1]" in r["nan"], r["nan"]
        assert "no parameter or momentum changed on any rank" in r["nan"], r["nan"]
        assert r["nan_changed_nothing"] and r["none_kept"] and r["others_moved"], r
        assert "p.grad of 'a.weight' is a DTensor placed (Shard(dim=0),)" in r["sharded"], r["sharded"]
        assert r["steps"] == 3, r
    assert len({r["digest"] for r in res}) == 1


def scaler_clip_like_ddp(rank, world_size):
    """GradScaler with the user's unscale_, clip_grad_norm_ and an overflow
    on rank 0 at step 2 (every rank skips it and backs off): DDP, FSDP2, and
    FSDP2 with manual backward finalization end bitwise alike."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    out = []
    from torch.distributed.fsdp import FSDPModule

    manual = hasattr(FSDPModule, "set_manual_backward_finalization")  # torch >= 2.12
    for kind in ("ddp", "fsdp2", "fsdp2_manual") if manual else ("ddp", "fsdp2"):
        model = DDP(_net()) if kind == "ddp" else _shard(_net())
        if kind == "fsdp2_manual":
            model.set_manual_backward_finalization(True)
        opt = lionbit.DistributedLion(model.parameters(), **LION).attach(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(4):
            loss = _loss(model, rank, step)
            scaler.scale(loss * 1e38 if (step, rank) == (2, 0) else loss).backward()
            if kind == "fsdp2_manual":
                model.finalize_backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        params = [p.detach() for p in model.module.parameters()] if kind == "ddp" else _full_params(model)
        out.append([_digest(params), scaler.get_scale(), opt.steps_taken])
    return out


def test_fsdp2_grad_scaler_unscale_and_clip_equal_ddp():
    from torch.distributed.fsdp import FSDPModule

    kinds = 3 if hasattr(FSDPModule, "set_manual_backward_finalization") else 2  # torch 2.11: no manual kind
    res = values(run_ranks("test_fsdp:scaler_clip_like_ddp", 2))
    for r in res:
        assert len(r) == kinds and all(x == res[0][0] for x in r), r
        assert r[0][1:] == [512.0, 3], r  # one skipped step, one back-off


@contextlib.contextmanager
def chunk_limit(limit):
    """The most elements of planes a call (step_vote.chunk_limit) for one
    case, put back after it: the pooled ranks run the next case too."""
    from lionbit import step_vote

    saved = step_vote.CHUNK_ELEMENTS
    if limit is not None:
        step_vote.CHUNK_ELEMENTS = limit
    try:
        yield
    finally:
        step_vote.CHUNK_ELEMENTS = saved


def fsdp_bytes(rank, world_size, steps, limit=None):
    with chunk_limit(limit):
        return _fsdp_bytes(rank, world_size, steps)


def _fsdp_bytes(rank, world_size, steps):
    import lionbit

    model, opt, _ = _train_fsdp(rank, 1, 1, "vote")
    # Per-rank shard sizes of the three units: a, b, root (head).
    units = []
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            s = 0
            for p in m.parameters(recurse=False) if m is not model else model.head.parameters():
                dim0 = p.shape[0]
                rows = -(-dim0 // world_size)
                s += rows * (p.numel() // dim0)
            units.append(s)
    lionbit.reset_stats()
    for step in range(1, steps + 1):
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    st = lionbit.stats()
    return {"stats": st, "units": units}


def test_runs_keep_order_key_and_limit():
    """voter.runs, which groups FSDP's units into calls: consecutive items of
    one key while their sizes fit the limit; an item over it alone."""
    from lionbit.voter import end_to_end, runs

    items = [("a", 3), ("a", 4), ("a", 2), ("b", 1), ("b", 20), ("b", 5), ("a", 1), ("a", 10)]
    got = runs(items, lambda it: it[0], lambda it: it[1], lambda it: 10)
    assert got == [[("a", 3), ("a", 4), ("a", 2)], [("b", 1)], [("b", 20)], [("b", 5)], [("a", 1)], [("a", 10)]]
    assert runs([], lambda it: it, lambda it: 1, lambda it: 1) == []
    # end_to_end: part i's spans land after the earlier parts' chunk in every shard
    g = torch.zeros(1)
    first, second = [(g, g, None, [(0, 0, 2, 1), (1, 2, 3, 0)])], [(g, g, None, [(1, 0, 1, 4)])]
    pieces, s, bases = end_to_end([(first, 5), (second, 7)])
    assert (s, bases) == (12, [0, 5])
    assert [p[3] for p in pieces] == [[(0, 0, 2, 1), (1, 2, 3, 0)], [(1, 0, 1, 9)]]


@pytest.mark.parametrize("world_size,limit", [(2, None), (4, None), (2, 1)])
def test_fsdp2_bytes_per_step_are_the_phase1_figure(world_size, limit):
    """The units' chunks end to end in one reduce-scatter a step, or (a limit
    below any unit's planes) one a unit: the bytes are the phase-1 figure of
    what each call carries."""
    steps = 3
    res = values(run_ranks("test_fsdp:fsdp_bytes", world_size, kwargs=dict(steps=steps, limit=limit)))
    n = world_size
    for r in res:
        st, units = r["stats"], r["units"]
        calls = [sum(units)] if limit is None else units  # each call's shard elements
        assert st["sign_reduce_scatter_calls"] == steps * len(calls)
        assert st["sign_allreduce_calls"] == 0
        payload = sum((n - 1) * 8 * -(-s // 64) for s in calls)  # (N-1)/N of the N shards' packed bits
        header = len(calls) * 72 * (n - 1)  # the 72-byte header round
        # zero-free directions: exactly the formula, nothing else
        assert st["bytes_sent"] == steps * (payload + header), (st, units)
        d = sum(units) * n
        assert payload <= (n - 1) / n * d / 8 + len(calls) * (n - 1) * 8


def fsdp_checkpoint(rank, world_size, path):
    """Per momentum dtype: an uninterrupted run of 10 steps (lr changed after
    step 5) against 5 steps, a DCP save, a fresh model from another seed with
    another lr loading the checkpoint, and 5 more steps."""
    import torch.distributed.checkpoint as dcp

    import lionbit

    def build(md, seed):
        model = _shard(_net(seed))
        opt = lionbit.DistributedLion(model.parameters(), momentum_dtype=md, **LION)
        return model, opt.attach(model)

    def train(model, opt, steps):
        for step in steps:
            if step == 5:
                opt.param_groups[0]["lr"] = 0.005  # a scheduler's change must survive too
            _loss(model, rank, step).backward()
            opt.step()
            opt.zero_grad()

    def digests(model, opt):
        momenta = [opt.state[p]["exp_avg"] for p in opt.param_groups[0]["params"]]
        return {"params": _digest(_full_params(model)), "momentum": _digest(momenta)}

    out = {}
    for md in (torch.float32, torch.bfloat16):
        where = os.path.join(path, str(md))
        model, opt = build(md, 0)
        train(model, opt, range(10))
        full = digests(model, opt)

        model, opt = build(md, 0)
        train(model, opt, range(6))  # the lr change happened before the save
        dcp.save({"model": model.state_dict(), "optim": opt.sharded_state_dict()}, checkpoint_id=where)

        model, opt = build(md, 1)  # other weights, other lr: all must come from the checkpoint
        opt.param_groups[0]["lr"] = 0.123
        sd = {"model": model.state_dict(), "optim": opt.sharded_state_dict()}
        dcp.load(sd, checkpoint_id=where)
        model.load_state_dict(sd["model"])
        opt.load_sharded_state_dict(sd["optim"])
        assert opt.param_groups[0]["lr"] == 0.005
        train(model, opt, range(6, 10))
        out[str(md)] = {"full": full, "resumed": digests(model, opt)}
    return out


def test_fsdp2_dcp_checkpoint_resume_is_bitwise(tmp_path):
    n = 3
    res = values(run_ranks("test_fsdp:fsdp_checkpoint", n, kwargs=dict(path=str(tmp_path))))
    for md in ("torch.float32", "torch.bfloat16"):
        for r in res:
            assert r[md]["resumed"] == r[md]["full"]
        # each rank's momentum is its own (different local data)
        assert len({r[md]["resumed"]["momentum"] for r in res}) == n
        assert len({r[md]["resumed"]["params"] for r in res}) == 1


def plain_fsdp(rank, world_size, steps):
    model = _shard(_net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
    return _digest(_full_params(model))


def test_plain_fsdp2_over_lionbit_equals_gloo():
    lion = values(run_ranks("test_fsdp:plain_fsdp", 2, kwargs=dict(steps=5)))
    gloo = values(run_ranks("test_fsdp:plain_fsdp", 2, backend="gloo", kwargs=dict(steps=5)))
    assert lion == gloo
    assert len(set(lion)) == 1


def fsdp_mixed_precision(rank, world_size, steps):
    out = {}
    for nested in (True, False):
        model, _, losses = _train_fsdp(rank, steps, 1, "vote", nested=nested, mp=torch.bfloat16, fixed_batch=True)
        full = _full_params(model)
        assert all(p.dtype == torch.float32 for p in full)
        out[str(nested)] = {"digest": _digest(full), "first": losses[0], "last": sum(losses[-3:]) / 3}
    return out


def test_fsdp2_mixed_precision_bf16_params():
    res = values(run_ranks("test_fsdp:fsdp_mixed_precision", 2, kwargs=dict(steps=30)))
    for r in res:
        # one unit or three: the same local bf16 gradients, the same votes
        assert r["True"]["digest"] == r["False"]["digest"]
        assert r["True"]["last"] < r["True"]["first"]
    assert res[0]["True"]["digest"] == res[1]["True"]["digest"]


def reduce_scatter_collective(rank, world_size, cases):
    import lionbit

    ok = []
    for s, op, dtype in cases:
        g = torch.Generator().manual_seed(rank + s)
        x = torch.randint(-1, 2, (world_size * s,), generator=g).to(getattr(torch, dtype))
        everyone = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(everyone, x)
        total = torch.stack([torch.sign(t.double()) for t in everyone]).sum(0)
        expect = {"vote": torch.sign(total), "avg": total / world_size, "sum": total}[op]
        expect = expect[rank * s : (rank + 1) * s].to(x.dtype)
        out = torch.full((s,), 7, dtype=x.dtype)
        lionbit.reduce_scatter_sign(out, x, op=op)
        ok.append(bool(torch.equal(out, expect)))
    return {"ok": ok, "stats": lionbit.stats()}


def test_reduce_scatter_sign_against_float64():
    cases = [(1000, "vote", "float32"), (70, "avg", "bfloat16"), (1, "sum", "float32"), (0, "vote", "float32"),
             (130, "vote", "int8")]
    res = values(run_ranks("test_fsdp:reduce_scatter_collective", 3, kwargs=dict(cases=cases)))
    for r in res:
        assert r["ok"] == [True] * len(cases)
        assert r["stats"]["sign_reduce_scatter_calls"] == len(cases)


COLLECTIVE_CASES = {
    "size_mismatch": {1: "argument 'input' has", "others": "rank(s) [1] rejected their input"},
    "shard_mismatch": "number of elements differs across ranks",
    "nan": "NaN on rank(s) [1]",
    "kind_mismatch": "collective differs across ranks",
}
ATTACH_CASES = {
    "offload": "CPUOffloadPolicy is not supported",
    "missing_param": "is not in this optimizer",
    "fp16_reduce": "FSDP reduces torch.float16 gradients with RedOpType.SUM, dividing them before the reduction",
    "not_root": "call fully_shard on the root module too",
    "ignored_params": "['b.weight'] are the model's but not sharded by FSDP (fully_shard's ignored_params)",
    "another_models": "2 of this optimizer's parameters are not parameters of the model it is attached to",
    "not_attached": "not attached to the model; call opt.attach(model)",
}


def errors(rank, world_size, cases):
    import lionbit

    seen = {}
    for case in cases:
        try:
            _error_case(rank, world_size, case)
            seen[case] = "no error"
        except Exception as err:  # noqa: BLE001 - reported to the test
            seen[case] = f"{type(err).__name__}: {err}"
        if case in COLLECTIVE_CASES:
            # the communicator stays usable after the error
            out = torch.zeros(5)
            lionbit.reduce_scatter_sign(out, torch.arange(world_size * 5.0) - 7)
            assert torch.equal(out, torch.sign(torch.arange(rank * 5.0, rank * 5.0 + 5) - 7))
    return seen


def _error_case(rank, world_size, case):
    from torch.distributed.fsdp import fully_shard

    import lionbit
    if case == "size_mismatch":
        out = torch.zeros(10)
        x = torch.ones(world_size * 10 + (rank == 1))
        lionbit.reduce_scatter_sign(out, x)
    elif case == "shard_mismatch":
        s = 10 + rank
        lionbit.reduce_scatter_sign(torch.zeros(s), torch.ones(world_size * s))
    elif case == "nan":
        x = torch.ones(world_size * 10)
        if rank == 1:
            x[3] = float("nan")
        lionbit.reduce_scatter_sign(torch.zeros(10), x)
    elif case == "kind_mismatch":
        x = torch.ones(world_size * 64)
        if rank == 0:
            lionbit.all_reduce_sign(x)
        else:
            lionbit.reduce_scatter_sign(torch.zeros(64), x)
    elif case == "offload":
        from torch.distributed.fsdp import CPUOffloadPolicy

        model = fully_shard(_net(), offload_policy=CPUOffloadPolicy(pin_memory=False))
        lionbit.DistributedLion(model.parameters()).attach(model)
    elif case == "missing_param":
        model = _shard(_net())
        lionbit.DistributedLion(model.b.parameters()).attach(model)
    elif case == "fp16_reduce":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        model = _shard(_net(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16))
        opt = lionbit.DistributedLion(model.parameters())
        opt.attach(model)
        _loss(model, rank, 0).backward()
    elif case == "not_root":
        model = _net()
        fully_shard(model.a)
        lionbit.DistributedLion(model.parameters()).attach(model)
    elif case == "ignored_params":
        model = _net()
        fully_shard(model.a)
        fully_shard(model, ignored_params={model.b.weight})
        lionbit.DistributedLion(model.parameters()).attach(model)
    elif case == "another_models":
        model, other = _shard(_net()), _net()
        lionbit.DistributedLion([*model.parameters(), *other.b.parameters()]).attach(model)
    elif case == "not_attached":  # FSDP2's DTensors stepped as a plain module's parameters
        model = _shard(_net())
        opt = lionbit.DistributedLion(model.parameters())
        _loss(model, rank, 0).backward()
        opt.step()
    elif case == "gloo_group":
        model = _shard(_net())
        lionbit.DistributedLion(model.parameters()).attach(model)


@pytest.mark.parametrize(
    "cases,world_size,backend",
    [(COLLECTIVE_CASES, 3, "lionbit"), (ATTACH_CASES, 4, "lionbit"), ({"gloo_group": "not lionbit"}, 2, "gloo")],
)
def test_errors(cases, world_size, backend):
    res = values(run_ranks("test_fsdp:errors", world_size, backend=backend, kwargs=dict(cases=list(cases)),
                           timeout=150))
    for rank, seen in enumerate(res):
        for case, expect in cases.items():
            want = expect.get(rank, expect.get("others")) if isinstance(expect, dict) else expect
            assert want in seen[case], (rank, case, seen[case])
