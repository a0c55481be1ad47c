"""DistributedLion inside the training loops users write: gradient clipping,
GradScaler with an overflow on one rank, gradient accumulation, bf16
autocast, activation checkpointing (non-reentrant, of a layer that is an
FSDP unit of its own: FSDP gathers it again in backward), under DDP (votes
started in backward, and at step()), FSDP2 and
FSDP1, at N = 2 and 3.

Every rank also runs a single-process simulation of Distributed Lion
(``simulate``, plain torch ops, written from the paper's update rule and the
float contract in lionbit.lion_math, not from lionbit's code): N model copies,
each with its own momentum, the same loop operation applied on every
simulated rank, the vote as sign(sum of signs). DDP must equal it bitwise;
so must FSDP wherever FSDP computes the same local gradients (bare,
accumulation, bf16 autocast, and clipping: FSDP2 with
torch.nn.utils.clip_grad_norm_, FSDP1 with model.clip_grad_norm_; GradScaler
under FSDP2 too: the tests compare bitwise). GradScaler under FSDP1 raises a
clear error at the first step (README "Training loops").
"""

import copy
import hashlib
import math
import os

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks, values

LION = dict(lr=0.02, betas=(0.9, 0.99), weight_decay=0.1)
STEPS = 6
OVERFLOW_STEP = 2  # GradScaler case: rank 1's loss overflows at this step
OVERFLOW_RANK = 1


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(10, 24)
        self.b = torch.nn.Linear(24, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, checkpoint=False):
        if checkpoint:  # recomputed in backward, as transformers' gradient_checkpointing_enable() does
            h = torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=False)
        else:
            h = self.a(x)
        return self.head(torch.tanh(self.b(torch.tanh(h))))


def _net():
    torch.manual_seed(0)
    return Net()


def _batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(16, 10, generator=g), torch.randint(0, 4, (16,), generator=g)


def _loss(model, rank, step, micro, loop):
    x, y = _batch(rank, step, micro)
    if loop == "bf16_autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out = out.float()
    else:
        out = model(x, checkpoint=loop == "checkpoint")
    loss = torch.nn.functional.cross_entropy(out, y)
    if loop == "grad_scaler" and step == OVERFLOW_STEP and rank == OVERFLOW_RANK:
        loss = loss * 1e38  # times the scale: inf gradients on this rank only
    return loss


def _micro_batches(loop):
    return 2 if loop == "accumulate" else 1


def _digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().float().numpy().tobytes())
    return h.hexdigest()


# -- the reference -------------------------------------------------------------


def _f32(v):
    return torch.tensor(v, dtype=torch.float32)


def simulate(n, loop):
    """Distributed Lion on n simulated ranks in one process. Returns the
    parameters after STEPS steps, the final GradScaler scale (or None) and
    each simulated rank's gradients after the first backward."""
    b1, b2 = LION["betas"]
    lr, wd = LION["lr"], LION["weight_decay"]
    cb1, comb1, cb2, comb2, clr, cdecay = (_f32(v) for v in (b1, 1 - b1, b2, 1 - b2, lr, 1 - lr * wd))
    model = _net()
    replicas = [copy.deepcopy(model) for _ in range(n)]
    momenta = [[torch.zeros_like(p) for p in model.parameters()] for _ in range(n)]
    scale = 65536.0 if loop == "grad_scaler" else None
    first_grads = None
    for step in range(STEPS):
        grads = []
        for r, rep in enumerate(replicas):
            for p, q in zip(rep.parameters(), model.parameters()):
                p.data.copy_(q.data)
                p.grad = None
            for micro in range(_micro_batches(loop)):
                loss = _loss(rep, r, step, micro, loop)
                if scale is not None:
                    loss = loss * torch.tensor(scale, dtype=torch.float32)
                loss.backward()
            g = [p.grad.clone() for p in rep.parameters()]
            if step == 0:
                first_grads = first_grads or []
                first_grads.append([t.clone() for t in g])
            if scale is not None:
                inv = torch.tensor(1.0 / scale, dtype=torch.float32)
                g = [t * inv for t in g]
            if loop == "clip":
                # The user's own call, on this simulated rank's gradients.
                for p, t in zip(rep.parameters(), g):
                    p.grad = t
                torch.nn.utils.clip_grad_norm_(rep.parameters(), 1.0)
                g = [p.grad.clone() for p in rep.parameters()]
            grads.append(g)
        if any(not torch.isfinite(t).all() for g in grads for t in g):
            assert scale is not None, "the reference saw a non-finite gradient in a loop without a scaler"
            scale *= 0.5  # every rank skips; the scaler backs off
            continue
        signs = []
        for r in range(n):
            dirs = []
            for i, (g, m) in enumerate(zip(grads[r], momenta[r])):
                c = torch.add(torch.mul(m, cb1), torch.mul(g, comb1))
                momenta[r][i] = torch.add(torch.mul(m, cb2), torch.mul(g, comb2))
                dirs.append(torch.sign(c))
            signs.append(dirs)
        for i, p in enumerate(model.parameters()):
            delta = torch.sign(sum(s[i] for s in signs))
            p.data.copy_(torch.sub(torch.mul(p.data, cdecay), torch.mul(delta, clr)))
    return [p.detach().clone() for p in model.parameters()], scale, first_grads


# -- the distributed runs ------------------------------------------------------


def _user_step(opt, model, loop, scaler, clip):
    if loop == "grad_scaler":
        scaler.step(opt)
        scaler.update()
        return
    if loop == "clip":
        clip()
    opt.step()


def ddp_loop(rank, n, loop, overlap, compiled=False, double_buffer=False, compiled_step=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    torch.set_num_threads(1)
    model = _net()
    if loop == "checkpoint_wrapper":
        _checkpoint_b(model)
    # several buckets (torch.compile's DDP optimizer wants the default sizes)
    ddp = DDP(model) if compiled else DDP(model, bucket_cap_mb=0.001)
    opt = lionbit.DistributedLion(ddp.parameters(), **LION, double_buffer=double_buffer)
    opt.attach(ddp, overlap=overlap)
    if compiled:
        ddp = torch.compile(ddp)
    if compiled_step:  # torch's recipe for a faster optimizer step: DistributedLion's runs as it is inside
        opt.step = torch.compile(opt.step)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0) if loop == "grad_scaler" else None
    norms = []
    ref_params, ref_scale, ref_grads = simulate(n, loop)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=(step % 2 == 0))  # both habits
        for micro in range(_micro_batches(loop)):
            if micro < _micro_batches(loop) - 1:
                with ddp.no_sync():
                    loss = _loss(ddp, rank, step, micro, loop)
                    (scaler.scale(loss) if scaler else loss).backward()
            else:
                loss = _loss(ddp, rank, step, micro, loop)
                (scaler.scale(loss) if scaler else loss).backward()
        if step == 0:
            # The contract: p.grad is this rank's own (scaled) local gradient.
            # (Compiled kernels round differently from eager ones: close, not equal.)
            for p, want in zip(model.parameters(), ref_grads[rank]):
                same = torch.allclose(p.grad, want, rtol=1e-4, atol=1e-6) if compiled else torch.equal(p.grad, want)
                assert same, "p.grad after backward is not the local gradient"
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))

        def clip():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

        _user_step(opt, model, loop, scaler, clip)
    for got, want in zip(model.parameters(), ref_params):
        if compiled:  # a rounding difference can flip a vote: at most 2 lr per step and element
            assert (got.detach() - want).abs().max() <= 2 * LION["lr"] * STEPS
            continue
        assert torch.equal(got.detach(), want), f"DDP {loop} (overlap={overlap}) differs from the simulation"
    if scaler is not None:
        assert scaler.get_scale() == ref_scale, (scaler.get_scale(), ref_scale)
    assert all(math.isfinite(v) for i, v in enumerate(norms) if not (loop == "grad_scaler" and i == OVERFLOW_STEP))
    return {
        "digest": _digest(model.parameters()),
        "fallbacks": opt.attachment.fallbacks,
        "overlap_now": opt.attachment.overlap,
        "scale": scaler.get_scale() if scaler else None,
    }


LOOPS = ["bare", "clip", "grad_scaler", "accumulate", "bf16_autocast"]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at_step"])
@pytest.mark.parametrize("loop", LOOPS)
def test_ddp_loop_equals_simulation(loop, overlap, n):
    res = values(run_ranks("test_training_loops:ddp_loop", n, kwargs={"loop": loop, "overlap": overlap}))
    assert len({r["digest"] for r in res}) == 1, "replicas differ"
    if overlap:
        changes_grads = loop in ("clip", "grad_scaler")
        # Votes started in backward are kept exactly where the gradients were
        # not touched; a loop that touches them falls back once, for good.
        assert all(r["fallbacks"] == (1 if changes_grads else 0) for r in res), res
        assert all(r["overlap_now"] == (not changes_grads) for r in res), res
    if loop == "grad_scaler":
        assert len({r["scale"] for r in res}) == 1


def ddp_nonfinite_in_the_last_bucket(rank, n):
    """DDP with overlap and one bucket per parameter; at step 2 the last
    rank's gradient of the first layer's weight (the last bucket DDP
    fills) holds a NaN. Every bucket's parameters are updated as soon as
    its vote is in, so the step must know before the first update that a
    later bucket is bad: every rank raises naming that rank, and no
    parameter or momentum changes on any rank. Training then goes on with
    the votes still started in backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    torch.set_num_threads(1)
    model = _net()
    ddp = DDP(model, bucket_cap_mb=0.001)
    opt = lionbit.DistributedLion(ddp.parameters(), **LION)
    opt.attach(ddp)
    bad_step, bad_rank, now = 2, n - 1, [0]

    def poison(g):
        if rank == bad_rank and now[0] == bad_step:
            g = g.clone()
            g[0, 0] = float("nan")
        return g

    model.a.weight.register_hook(poison)
    errors = []
    for step in range(5):
        now[0] = step
        opt.zero_grad()
        _loss(ddp, rank, step, 0, "bare").backward()
        before = [t.detach().clone() for t in model.parameters()] + [s["exp_avg"].clone() for s in opt.state.values()]
        try:
            opt.step()
        except RuntimeError as err:
            errors.append((step, str(err)))
            after = [t.detach() for t in model.parameters()] + [s["exp_avg"] for s in opt.state.values()]
            assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refused step changed state"
    return {"errors": errors, "digest": _digest(model.parameters()), "steps": opt.steps_taken,
            "overlap": opt.attachment.overlap, "fallbacks": opt.attachment.fallbacks}


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_overlap_nonfinite_in_the_last_bucket_changes_nothing(n):
    res = values(run_ranks("test_training_loops:ddp_nonfinite_in_the_last_bucket", n))
    for r in res:
        assert [step for step, _ in r["errors"]] == [2], r
        assert f"non-finite gradient (inf or NaN) on rank(s) [{n - 1}]" in r["errors"][0][1], r
        assert "no parameter or momentum changed on any rank" in r["errors"][0][1], r
        assert r["steps"] == 4 and r["overlap"] and r["fallbacks"] == 0, r
    assert len({r["digest"] for r in res}) == 1, "replicas differ"


def test_ddp_torch_compile_equals_simulation():
    res = values(run_ranks("test_training_loops:ddp_loop", 2,
                           kwargs={"loop": "clip", "overlap": True, "compiled": True}))
    assert len({r["digest"] for r in res}) == 1 and all(r["fallbacks"] == 1 for r in res), res


@pytest.mark.parametrize("loop", ["clip", "grad_scaler"])
def test_ddp_with_a_compiled_optimizer_step_equals_simulation(loop):
    """``opt.step = torch.compile(opt.step)``: Dynamo failed inside the step
    (an opaque process-group object); the step is now left to run eagerly,
    so the steps equal the simulation's bitwise."""
    res = values(run_ranks("test_training_loops:ddp_loop", 2,
                           kwargs={"loop": loop, "overlap": True, "compiled_step": True}))
    assert len({r["digest"] for r in res}) == 1, res


def _checkpoint_b(model, fsdp1=False):
    """Layer b recomputed in backward by torch's own wrapper (non-reentrant):
    torchtitan's order for FSDP2 and DDP (the wrapper first, then the
    sharding), the FSDP1 tutorial's apply_activation_checkpointing on the
    wrapped model. The reference is the model without it (the same math)."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrapper = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if fsdp1:
        target = model.module.b if hasattr(model, "module") else model.b
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: m is target)
        return
    model.b = wrapper(model.b)


def _shard(model, kind, loop="bare"):
    wrapped = loop == "checkpoint_wrapper"
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        if wrapped:
            _checkpoint_b(model)
        fully_shard(model.a)
        fully_shard(model.b)
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    cpu = torch.device("cpu")
    if kind == "fsdp1_no_shard":
        model = FSDP(model, device_id=cpu, use_orig_params=True, sharding_strategy=ShardingStrategy.NO_SHARD)
    else:
        model.a = FSDP(model.a, device_id=cpu, use_orig_params=True)
        model = FSDP(model, device_id=cpu, use_orig_params=True)
    if wrapped:
        _checkpoint_b(model, fsdp1=True)
    return model


def fsdp_loop(rank, n, kind, loop):
    import lionbit

    torch.set_num_threads(1)
    model = _shard(_net(), kind, loop)
    opt = lionbit.DistributedLion(model.parameters(), **LION)
    opt.attach(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0) if loop == "grad_scaler" else None
    # Which loops raise: GradScaler under FSDP1. Clipping works everywhere:
    # FSDP2 and NO_SHARD keep DDP's contract (p.grad is the local gradient,
    # voted at step()); sharded FSDP1 clips per rank with model.clip_grad_norm_.
    raises = kind != "fsdp2" and loop == "grad_scaler"
    ref_params, ref_scale, ref_grads = simulate(n, loop) if not raises else (None, None, None)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(_micro_batches(loop)):
            last = micro == _micro_batches(loop) - 1
            if kind == "fsdp2":
                model.set_requires_gradient_sync(last)
                ctx = None
            else:
                ctx = None if last else model.no_sync()
            if ctx is None:
                loss = _loss(model, rank, step, micro, loop)
                (scaler.scale(loss) if scaler else loss).backward()
            else:
                with ctx:
                    _loss(model, rank, step, micro, loop).backward()

        def clip():
            if kind == "fsdp2":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                model.clip_grad_norm_(1.0)

        if kind in ("fsdp1_no_shard", "fsdp2") and step == 0 and ref_grads is not None:
            # The contract: p.grad is this rank's own local gradient (FSDP2:
            # its DTensor of the parameter's shape, placed Replicate()).
            for p, want in zip(model.parameters(), ref_grads[rank]):
                got = p.grad.to_local() if kind == "fsdp2" else p.grad
                assert torch.equal(got, want), "p.grad after backward is not the local gradient"
        if raises:
            with pytest.raises(RuntimeError) as err:
                _user_step(opt, model, loop, scaler, clip)
            msg = str(err.value)
            want = "GradScaler is not supported with FSDP" if loop == "grad_scaler" else "gradients were changed"
            assert want in msg and ("bfloat16" in msg or "remove the call" in msg), msg
            return {"error": msg[:60]}
        _user_step(opt, model, loop, scaler, clip)
    if kind == "fsdp2":
        full = [p.full_tensor() for p in model.parameters()]
    else:
        with model.summon_full_params(model):
            full = [p.detach().clone() for p in model.parameters()]
    for got, want in zip(full, ref_params):
        assert torch.equal(got, want), f"{kind} {loop} differs from the simulation"
    if scaler is not None:
        assert scaler.get_scale() == ref_scale, (scaler.get_scale(), ref_scale)
    return {"digest": _digest(full)}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1", "fsdp1_no_shard"])
def test_fsdp_loop(kind, loop, n):
    res = values(run_ranks("test_training_loops:fsdp_loop", n, kwargs={"kind": kind, "loop": loop}))
    assert len({str(r) for r in res}) == 1, res


@pytest.mark.parametrize("loop", ["checkpoint", "checkpoint_wrapper"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "at_step"])
def test_ddp_activation_checkpointing_equals_simulation(overlap, loop):
    """The checkpointed layer's gradients come from its recomputation in
    backward: the hook's votes start as under a plain backward."""
    res = values(run_ranks("test_training_loops:ddp_loop", 2, kwargs={"loop": loop, "overlap": overlap}))
    assert len({r["digest"] for r in res}) == 1, "replicas differ"
    assert all(r["fallbacks"] == 0 and r["overlap_now"] == overlap for r in res), res


@pytest.mark.parametrize("loop", ["checkpoint", "checkpoint_wrapper"])
@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1", "fsdp1_no_shard"])
def test_fsdp_activation_checkpointing_equals_simulation(kind, loop):
    res = values(run_ranks("test_training_loops:fsdp_loop", 2, kwargs={"kind": kind, "loop": loop}))
    assert len({str(r) for r in res}) == 1, res


# -- the rest of a training script's habits ------------------------------------


def checkpoint_habits(rank, n, ckpt_dir):
    """Per-rank optimizer files resume bitwise with no warning; loading rank
    0's file on every rank (nanoGPT's habit) works and warns on the others;
    state_dict() runs no collective (rank 0 alone calls it)."""
    import os
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    torch.set_num_threads(1)

    def build():
        model = _net()
        ddp = DDP(model)
        opt = lionbit.DistributedLion(ddp.parameters(), **LION)
        opt.attach(ddp)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return model, ddp, opt, sched

    def train(ddp, opt, sched, steps):
        for step in steps:
            opt.zero_grad(set_to_none=False)
            _loss(ddp, rank, step, 0, "bare").backward()
            opt.step()
            sched.step()

    model, ddp, opt, sched = build()
    train(ddp, opt, sched, range(3))
    if rank == 0:
        opt.state_dict()  # a rank-0-only call: no collective inside, or the barrier below would hang
    dist.barrier()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
               os.path.join(ckpt_dir, f"rank{rank}.pt"))
    dist.barrier()
    train(ddp, opt, sched, range(3, 6))
    want = _digest(model.parameters())

    model, ddp, opt, sched = build()
    ck = torch.load(os.path.join(ckpt_dir, f"rank{rank}.pt"))
    model.load_state_dict(ck["model"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a rank's own file
        opt.load_state_dict(ck["opt"])
    sched.load_state_dict(ck["sched"])
    train(ddp, opt, sched, range(3, 6))
    assert _digest(model.parameters()) == want, "per-rank resume is not bitwise"

    model, ddp, opt, sched = build()
    ck = torch.load(os.path.join(ckpt_dir, "rank0.pt"))
    model.load_state_dict(ck["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(ck["opt"])
    said = [str(w.message) for w in caught if "momentum of rank 0" in str(w.message)]
    assert len(said) == (0 if rank == 0 else 1), said
    sched.load_state_dict(ck["sched"])
    train(ddp, opt, sched, range(3, 6))
    return _digest(model.parameters())


def test_checkpoints_the_way_scripts_write_them(tmp_path):
    res = values(run_ranks("test_training_loops:checkpoint_habits", 2, kwargs={"ckpt_dir": str(tmp_path)}))
    assert res[0] == res[1], "replicas differ after every rank loaded rank 0's momentum"


def unattached_ddp(rank, n):
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    model = _net()
    ddp = DDP(model)
    opt = lionbit.DistributedLion(ddp.parameters(), **LION)  # no attach: DDP all-reduces in fp32
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            opt.zero_grad()
            _loss(ddp, rank, step, 0, "bare").backward()
            opt.step()
    said = [w for w in caught if "was not attached" in str(w.message)]
    assert len(said) == 1 and "opt.attach(ddp_model)" in str(said[0].message), [str(w.message) for w in caught]
    # Attributed to the user's opt.step() line, not to lionbit's or torch's frames...
    assert os.path.abspath(said[0].filename) == os.path.abspath(__file__), (said[0].filename, said[0].lineno)
    # ...and alone: the search for DDP models raises no warning of its own.
    assert len(caught) == 1, [f"{w.category.__name__}: {w.message}" for w in caught]
    return True


def test_an_unattached_ddp_model_is_named_at_the_first_step():
    assert all(values(run_ranks("test_training_loops:unattached_ddp", 2)))


def rewrapped_not_attached(rank, n):
    """The model wrapped again (accelerate's free_memory() and prepare(), a
    framework's second fit) and the optimizer, attached to the first DDP,
    not attached to the new one: the new DDP all-reduces in fp32, which the
    first step after says, once."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    import lionbit

    model = _net()
    ddp = DDP(model)
    opt = lionbit.DistributedLion(ddp.parameters(), **LION).attach(ddp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            if step == 2:
                ddp = DDP(model)  # the old one is still attached (and alive: the attachment holds it)
            opt.zero_grad()
            _loss(ddp, rank, step, 0, "bare").backward()
            opt.step()
    said = [str(w.message) for w in caught if "was not attached" in str(w.message)]
    return {"said": said, "all": len(caught), "digest": _digest(model.parameters())}


def test_a_model_wrapped_again_and_not_attached_is_named():
    res = values(run_ranks("test_training_loops:rewrapped_not_attached", 2))
    for r in res:
        assert len(r["said"]) == 1 and "opt.attach(ddp_model)" in r["said"][0] and r["all"] == 1, r
    assert res[0]["digest"] == res[1]["digest"]
